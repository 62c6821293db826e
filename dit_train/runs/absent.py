"""The value of a key that one side of a comparison lacks (a checkpoint's saved config against today's, a study's
recorded design against today's). A refusal prints it as `absent`: the string "(absent)" it replaces was printed
quoted, as if someone had set the key to that text."""


class Absent:
    def __repr__(self) -> str:
        return "absent"


ABSENT = Absent()
