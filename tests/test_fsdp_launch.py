"""Launch plumbing without a cluster: srun without torchrun (one task per GPU, the submitit launcher) gets its
process-group variables from Slurm's, and a preemption signal that another handler owned before the trainer
(submitit's SIGUSR2 requeue) is handed back to it after the checkpoint."""

import os
import signal

import pytest

from conftest import needs_fashion
from dit_train.parallel import first_slurm_host, slurm_environment


@pytest.mark.parametrize("nodelist,first", [("gpu[003-004,9],cpu1", "gpu003"), ("r[1-2]-n[07-08]", "r1-n07"),
                                            ("node7", "node7"), ("a,b", "a"), ("n[10]", "n10")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_slurm_task_environment():
    step = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "13", "SLURM_STEP_NUM_TASKS": "32", "SLURM_LOCALID": "5",
            "SLURM_STEP_NODELIST": "gpu[003-006]", "SLURM_JOB_ID": "123456"}
    assert slurm_environment(step) == {"RANK": "13", "WORLD_SIZE": "32", "LOCAL_RANK": "5",
                                       "MASTER_ADDR": "gpu003", "MASTER_PORT": "23456"}
    assert slurm_environment({**step, "MASTER_ADDR": "head", "MASTER_PORT": "29500"})["MASTER_ADDR"] == "head"
    assert slurm_environment({**step, "WORLD_SIZE": "8"}) == {}  # torchrun's variables win
    assert slurm_environment({**step, "SLURM_STEP_NUM_TASKS": "1"}) == {}  # one task: single process
    no_step = {k: v for k, v in step.items() if k != "SLURM_STEP_ID"}
    assert slurm_environment(no_step) == {}  # the batch script itself, not an srun step


@needs_fashion
def test_preemption_signal_is_handed_to_the_previous_handler_after_the_checkpoint(tiny_cfg):
    from dit_train import checkpoint as ckpt
    from dit_train.parallel import DistInfo
    from dit_train.preemption import Preempted
    from dit_train.train import Trainer

    seen = []

    def submitit_like(signum, frame):
        seen.append((signum, [os.path.basename(p) for p in ckpt.list_checkpoints(tiny_cfg.run_dir)]))

    old = signal.signal(signal.SIGUSR2, submitit_like)
    try:
        tiny_cfg.train.ckpt_every = 0
        trainer = Trainer(tiny_cfg, DistInfo())
        step = trainer.train_step

        def signal_during_step_2(*a, **kw):
            if trainer.state.step == 1:
                os.kill(os.getpid(), signal.SIGUSR2)
            return step(*a, **kw)

        trainer.train_step = signal_during_step_2
        with pytest.raises(Preempted, match="received SIGUSR2 at step 2"):
            trainer.fit()
        assert seen == [(signal.SIGUSR2, ["step_00000002.dcp"])]  # called once, after the checkpoint
        assert signal.getsignal(signal.SIGUSR2) is submitit_like  # and restored
    finally:
        signal.signal(signal.SIGUSR2, old)
