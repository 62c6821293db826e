"""`python -m dit_train --help`: the composed config with each key's one-line doc after it, read from the schema
that declares the key (its `doc`, else what it accepts). conf/config.yaml's hydra.help.template calls
documented_config through the `documented_config` resolver (dit_train/__init__.py)."""

from __future__ import annotations

import re

from omegaconf import OmegaConf

from dit_train.config.schemas import run_schemas
from dit_train.config.fields import accepted, walk

KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_]\w*):(?P<rest>.*)$")
DOC_COLUMN = 36  # docs start here, or two spaces after a longer line


def key_docs(cfg) -> dict[str, str]:
    """Dotted key -> one-line doc for the composed config `cfg`: each key's doc in its schema, else what the
    schema accepts."""
    docs = {}
    for prefix, schema in run_schemas(cfg).items():
        for path, f, tp in walk(schema, f"{prefix}." if prefix else ""):
            doc = f.metadata.get("doc") or ("rule" in f.metadata and accepted(f, tp))
            if doc:
                docs[path] = doc
    return docs


def annotate(text: str, docs: dict[str, str]) -> str:
    """OmegaConf.to_yaml's text with `# doc` after each key that has one."""
    out: list[str] = []
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        m = KEY_LINE.match(line)
        if m is not None:
            indent = len(m["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, m["key"]))
            doc = docs.get(".".join(k for _, k in stack))
            if doc:
                line = f"{line.ljust(DOC_COLUMN - 2)}  # {doc}"
        out.append(line)
    return "\n".join(out)


def documented_config(root) -> str:
    """The config part of the --help text for the composed config `root` (hydra node included), with '$'
    doubled: Hydra reads the help template as a string.Template."""
    job = OmegaConf.to_container(root, resolve=False)
    job.pop("hydra", None)
    text = annotate(OmegaConf.to_yaml(job), key_docs(root))
    return text.replace("$", "$$")
