"""Who says `preempted: ...` on 2 real ranks (gloo) when the stop signal reaches them at slightly different moments,
as torchrun passes one on: rank 1 receives it before a vote, rank 0 only after that vote, while the checkpoint is
being finished. By the time the run stops both have it, so rank 0's line (with the signal's name) is the only one;
rank 1 used to add "rank 1 received SIGUSR1 ... (rank 0 did not; ...)", false by then (the flaky
test_fsdp_launch.py::test_a_stop_signal_to_torchrun_checkpoints_and_the_job_exits_75[10]). Where rank 0 never
receives one, rank 1's line is still added: the name is what rank 0 cannot know.

The signals are real (os.kill on the process itself) and their moments are set by hooks, not by a race: rank 1's
before step 2's all-reduce (or before the end-of-run evaluations' first vote), rank 0's when its checkpoint wait
starts with the stop already agreed. Three runs of one run folder cover both places that end a run with a stop:
mid-run (step 2 of 3), during the last step's evaluations (rank 0 receives nothing there), and during the end-of-run
work of a requeue."""

import json
import os
import signal

from conftest import compose, gloo_group, needs_fashion, spawn_ranks
from dit_train.trainer.preemption import Preempted

pytestmark = needs_fashion

# 2 ranks, 3 steps of 4 images; the validation is due at step 3 only (the end-of-run work), no periodic checkpoint
CONFIG = ["model.hidden_size=32", "model.depth=1", "model.num_heads=1", "model.patch_size=8", "train.steps=3",
          "train.batch_size=4", "train.warmup_steps=0", "train.log_every=1", "train.val_every=3",
          "train.val_samples=4", "train.val_batch_size=4", "train.val_t_points=1", "train.sample_every=0",
          "train.ckpt_every=0", "train.progress=false", "optimizer=adamw"]


def _signal_myself() -> None:
    os.kill(os.getpid(), signal.SIGUSR1)  # the trainer's handler records it at once (main thread)


def _three_stopped_runs(rank, world, port, root):
    with gloo_group(rank, world, port):
        from dit_train.evaluation.during_training import Evaluation
        from dit_train.runs.checkpoint_saver import CheckpointSaver
        from dit_train.trainer import loop
        from dit_train.trainer.loop import run

        trainers, rank1_at, rank0_too = [], [None], [True]
        originals = (loop.Trainer.fit, loop.Trainer.train_step, CheckpointSaver.wait, Evaluation.run_due)

        def fit(self):
            trainers.append(self)
            return originals[0](self)

        def train_step(self, *args, **kwargs):  # before the step's all-reduce, which carries the votes
            if rank == 1 and rank1_at[0] == self.state.step + 1:
                _signal_myself()
            return originals[1](self, *args, **kwargs)

        def wait(self, step):  # the checkpoint finished before the stop: rank 0's signal arrives now
            stopping = trainers[-1].preemption
            if rank == 0 and rank0_too[0] and stopping.requested and stopping.signal_name is None:
                _signal_myself()
            return originals[2](self, step)

        def run_due(self, *args, **kwargs):  # before the evaluations' first vote
            if rank == 1 and rank1_at[0] == "evaluations":
                _signal_myself()
            return originals[3](self, *args, **kwargs)

        loop.Trainer.fit, loop.Trainer.train_step, CheckpointSaver.wait, Evaluation.run_due = \
            fit, train_step, wait, run_due
        said = []
        try:
            for at, rank0_signals, extra in ((2, True, []), ("evaluations", False, ["train.resume=auto"]),
                                             ("evaluations", True, ["train.resume=auto"])):
                rank1_at[0], rank0_too[0] = at, rank0_signals
                try:
                    run(compose(CONFIG + [f"run_dir={root}/run", *extra]))
                    said.append(None)
                except Preempted as e:
                    said.append({"announce": e.announce, "line": str(e),
                                 "received": trainers[-1].preemption.signal_name})
        finally:
            loop.Trainer.fit, loop.Trainer.train_step, CheckpointSaver.wait, Evaluation.run_due = originals
        with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
            json.dump(said, f)


def test_a_signal_rank_0_receives_after_rank_1s_vote_is_said_once_by_rank_0(tmp_path):
    spawn_ranks(_three_stopped_runs, 2, (str(tmp_path),))
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    run_dir = tmp_path / "run"
    assert None not in rank0 + rank1  # every run was stopped, on both ranks
    # what each had received when it stopped
    assert [s["received"] for s in rank0] == ["SIGUSR1", None, "SIGUSR1"] and \
        [s["received"] for s in rank1] == ["SIGUSR1"] * 3
    end_of_run = (f"at step 3, the last, during the end-of-run work: its checkpoint was written first; skipped "
                  f"validation loss and summary.json; rerun with train.resume=auto run_dir={run_dir} to do only them")
    assert [s["line"] for s in rank0] == [
        f"received SIGUSR1 at step 2; checkpoint written, rerun with train.resume=auto run_dir={run_dir} to continue",
        f"received a stop signal (on another rank) {end_of_run}", f"received SIGUSR1 {end_of_run}"]
    # rank 0 says it, once per stop; rank 1 adds the signal's name only where rank 0 never received one
    assert [s["announce"] for s in rank0] == [True] * 3
    assert [s["announce"] for s in rank1] == [False, True, False], [s["line"] for s in rank1]
    assert rank1[1]["line"] == "rank 1 received SIGUSR1 at step 3 (rank 0 did not; its line says what to do)"
    assert not (run_dir / "summary.json").exists()
