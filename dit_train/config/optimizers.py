"""The optimizers' schemas, as the config layer reads them: each optimizer's Config dataclass is composed from
dit_train/optim/optimizer_config.py's keys by optim/catalog.py, one line per optimizer (torch-free: the command
line is checked before torch is imported). store.py registers each as the option
`optimizer=<name>`; the validator, --help and the resume policy read them here."""

from __future__ import annotations


def optimizer_names() -> list[str]:
    from dit_train.optim.catalog import OPTIMIZERS

    return sorted(OPTIMIZERS)


def optimizer_schema(name: str):
    """The Config dataclass of optimizer `name` (None if there is none)."""
    from dit_train.optim.catalog import OPTIMIZERS

    return OPTIMIZERS[name].config if name in OPTIMIZERS else None
