"""The FD jobs' flags say what they mean in --help (dit-reference-stats, dit-fd-dino share add_eval_args)."""

import argparse

from dit_train.evaluation.fd.job_config import add_eval_args


def test_reference_num_help_says_what_it_counts_and_its_default():
    ap = argparse.ArgumentParser(prog="dit-reference-stats")
    add_eval_args(ap)
    text = " ".join(ap.format_help().split())
    assert "--reference-num REFERENCE_NUM how many real images of --reference-split" in text
    assert "default: the eval preset's reference_num" in text
