"""Process group, FSDP2 wrapping, mixed precision, activation checkpointing and per-block compile.

Single process unless launched by torchrun (WORLD_SIZE > 1): NCCL on CUDA, gloo on CPU, chosen automatically.
Under torchrun the model is sharded with `torch.distributed.fsdp.fully_shard` (FSDP2): every
`parallel.blocks_per_fsdp_unit` consecutive DiT blocks (default 1) form one FSDP unit (their parameters all-gathered
in one collective just before the unit's first forward/backward and freed after its last), then the root takes the
rest (embedders, final layer). Parameters stay fp32 shards (what the optimizer and the EMA see); the gathered
compute copies are `parallel.mixed_precision` (bf16 on CUDA by default) and gradients are reduce-scattered in
`parallel.reduce_dtype` (fp32 by default).

HSDP (`parallel.replicate` R > 1): the ranks form an R x (W / R) mesh (replicate, shard); parameters are sharded
within each group of W / R consecutive ranks (a node) and replicated across the R groups, so the weight
all-gathers and gradient reduce-scatters stay inside a group and only the gradient shards are all-reduced across
groups. `shard_group` is the group a parameter's rows are split over, for every collective that sums over rows.

Every rank builds the model on the meta device, applies the plan, allocates only its own shards and computes
their initial values itself (weight_init: per-parameter seeded blocks, so a sharded run starts from exactly the
single-process weights); no rank ever holds a full copy, and nothing is sent at start-up.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dit_train.dtypes import torch_dtype
from dit_train.parallel.backend_env import use_gloo_interface, use_nccl_environment
from dit_train.parallel.matmul_precision import allow_tf32_globally

log = logging.getLogger("dit_train")


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[003-004,9],cpu1' -> 'gpu003', 'r[1-2]-n[07-08]' -> 'r1-n07'."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first top-level comma ends the first host expression
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)


def slurm_environment(environ=os.environ) -> dict[str, str]:
    """torch.distributed's env:// variables for one task per GPU started by srun without torchrun (e.g. the
    submitit launcher, launcher=slurm): RANK, WORLD_SIZE, LOCAL_RANK from the job step, MASTER_ADDR the step's
    first node, MASTER_PORT derived from the job id. Empty when torchrun set WORLD_SIZE, outside a job step,
    or for a single task. Variables already set are kept."""
    if "WORLD_SIZE" in environ or "SLURM_STEP_ID" not in environ or "SLURM_PROCID" not in environ:
        return {}
    world = int(environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or 1)
    if world <= 1:
        return {}
    nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or "localhost"
    out = {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": str(world),
           "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
           "MASTER_ADDR": environ.get("MASTER_ADDR") or first_slurm_host(nodes),
           "MASTER_PORT": environ.get("MASTER_PORT") or str(20000 + int(environ.get("SLURM_JOB_ID", "0")) % 40000)}
    return out


def init_distributed(single_process_group: bool = False, device: str | torch.device | None = None,
                     timeout_minutes: float = 10.0) -> DistInfo:
    """The one process-group set-up, for training and the evaluation jobs: from torchrun's environment
    (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR/PORT), or from Slurm's when srun started one task per GPU without
    torchrun; NCCL on CUDA, gloo on CPU. `single_process_group`: also create a group of one for a plain
    single-process run (parallel.fsdp=true without torchrun), so FSDP2 can be used on one device. `device`
    overrides the default (cuda:LOCAL_RANK when CUDA is present, else cpu). A collective that waits longer than
    `timeout_minutes` (a dead or hung peer; parallel.timeout_minutes, whose comment in config/schema.py sizes it)
    raises instead of hanging (gloo), or takes the process down with a flight-recorder dump (NCCL: the variables
    of backend_env.py, set before the group where the user has not set them)."""
    os.environ.update(slurm_environment())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", local_rank)
    elif torch.cuda.is_available():
        # one GPU visible per task (Slurm GPU binding) or all of them (torchrun): local rank modulo what is visible
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        allow_tf32_globally()  # the model's fp32 matmuls; the optimizer's run in full fp32 (matmul_precision.py)
    if not dist.is_initialized():
        if backend_for(device) == "nccl" and (world > 1 or single_process_group):
            use_nccl_environment()
        elif world > 1:  # a gloo default group (an NCCL job's one gloo group, for async saves: CheckpointSaver)
            use_gloo_interface()
        if world > 1:
            try:
                dist.init_process_group(backend_for(device), device_id=device if device.type == "cuda" else None,
                                        timeout=datetime.timedelta(minutes=timeout_minutes))
            except dist.DistNetworkError as e:
                if "EADDRINUSE" in str(e):
                    raise port_in_use(timeout_minutes) from None
                if "timed out" in str(e):  # rank > 0: rank 0's store never answered
                    raise ranks_not_joined(timeout_minutes, None) from None
                raise
            except dist.DistStoreError as e:  # rank 0: its store's wait for the other ranks ran out
                joined = re.search(r"(\d+)/(\d+) clients joined", str(e))
                if joined is None:
                    raise
                raise ranks_not_joined(timeout_minutes, int(joined.group(1))) from None
        elif single_process_group:
            dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)
    if dist.is_initialized():
        world = dist.get_world_size()
    rank = dist.get_rank() if dist.is_initialized() else 0
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


def port_in_use(timeout_minutes: float) -> Exception:
    """Rank 0's store could not listen on MASTER_PORT (srun without torchrun: another job's group on the node, or
    a port taken by anything else): one line saying which variable to change, not the store's traceback."""
    from dit_train.config.errors import ConfigError

    return ConfigError(f"MASTER_PORT={os.environ.get('MASTER_PORT')!r} on MASTER_ADDR="
                       f"{os.environ.get('MASTER_ADDR')!r} is in use (another job's process group on this node?): "
                       f"set MASTER_PORT to a free port; the other ranks give up after parallel.timeout_minutes="
                       f"{timeout_minutes:g}")


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than parallel.timeout_minutes (a peer rank died or hangs), or its transport saw a
    peer die (gloo: the connection closed at once)."""


def ranks_not_joined(timeout_minutes: float, joined: int | None) -> CollectiveTimeout:
    """The process group did not form within parallel.timeout_minutes (srun without torchrun: a task never started,
    or cannot reach MASTER_ADDR:MASTER_PORT): one line saying which ranks are missing and what to check, not the
    store's traceback. `joined`: rank 0's count of the ranks that joined its store (itself included); None on
    another rank, which never reached rank 0's store."""
    env = os.environ
    world, me = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
    where = f"MASTER_ADDR={env.get('MASTER_ADDR')} MASTER_PORT={env.get('MASTER_PORT')}"
    within = f"within parallel.timeout_minutes={timeout_minutes:g}"
    if joined is None:
        return CollectiveTimeout(f"rank {me}: rank 0's store at {where} did not answer {within}: check that rank 0's "
                                 f"task started and that MASTER_ADDR is its node's address, reachable from here")
    absent = world - joined
    which = (f"rank {world - 1}" if world == 2 else f"{absent} of ranks 1-{world - 1}")
    return CollectiveTimeout(f"rank 0: {joined} of {world} ranks joined the process group at {where} {within}; "
                             f"{which} did not: check that every task started (srun -n {world}, one per GPU) and "
                             f"is still running (a task that refused its config or run folder exited with its own "
                             f"line: see its log), and that the other nodes reach MASTER_ADDR:MASTER_PORT (raise "
                             f"parallel.timeout_minutes for tasks that start slowly)")


PEER_DIED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo's words for a dead peer


@contextlib.contextmanager
def collective_timeouts(timeout_minutes: float):
    """Turns the backend's timeout error (gloo: RuntimeError "Timed out ...", NCCL: DistBackendError), and gloo's report
    of a dead peer, into one line that says what happened (and for a wait, which knob sets it)."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        died = any(s in text for s in PEER_DIED)
        if isinstance(e, CollectiveTimeout) or not (died or "Timed out" in text or "timed out" in text
                                                    or "Timeout" in text):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        first = first.split(". This is typically")[0]  # gloo's advice after its words was cut mid-word at 160
        if died:
            raise CollectiveTimeout(f"rank {rank}: another rank died during a collective ({first[:160]}); "
                                    f"see its log for why") from None
        raise CollectiveTimeout(f"rank {rank}: a collective waited more than parallel.timeout_minutes="
                                f"{timeout_minutes:g} for another rank, which died or hangs ({first[:160]})") from None


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce_sum_(t: torch.Tensor) -> torch.Tensor:
    """In place over all ranks; the tensor itself for a single process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def broadcast_object(obj, src: int = 0):
    """rank `src`'s object on every rank (pickled); the object itself when not distributed."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# ---- the plan: what to apply, resolved once from cfg.parallel ------------------------------------------------
@dataclass(frozen=True)
class ParallelPlan:
    sharded: bool = False  # parameters are FSDP2 DTensor shards (any number of ranks, one included)
    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    reshard_after_forward: bool | int = True  # an int: keep the gathered weights sharded over groups of that size
    replicate: int = 1  # HSDP: replicas of the sharded model (the mesh's first dim); 1 is plain FSDP
    blocks_per_unit: int = 1  # consecutive blocks sharing one fully_shard (one set of hooks and collectives)
    activation_checkpointing: bool = False
    compile: bool = False

    def describe(self) -> str:
        name = lambda d: str(d).replace("torch.", "")
        if not self.sharded:
            mode = "single process"
        else:
            unit = "block" if self.blocks_per_unit == 1 else f"{self.blocks_per_unit} blocks"
            mode = (f"FSDP2 per {unit} + root, params {name(self.param_dtype)} / reduce {name(self.reduce_dtype)}, "
                    f"reshard_after_forward {self.reshard_after_forward}"
                    + (f", HSDP: {self.replicate} replicas" if self.replicate > 1 else ""))
        return f"{mode}; activation checkpointing {self.activation_checkpointing}; compile {self.compile}"


def wants_fsdp(pcfg, world_size: int) -> bool:
    """parallel.fsdp: auto -> FSDP2 when launched with more than one process; true -> always (a group of one
    for a single process); false -> never (only valid for a single process)."""
    choice = None if pcfg is None else pcfg.get("fsdp")
    return world_size > 1 if choice in (None, "auto") else bool(choice)


def resolve_plan(pcfg, dist_info: DistInfo) -> ParallelPlan:
    """The plan from cfg.parallel (checked, missing keys from ParallelConfig's defaults, by dit_train.config)."""
    from dit_train.config import check_parallel

    p = check_parallel(pcfg, dist_info.world_size)
    mp = p["mixed_precision"]
    if mp == "auto":
        mp = "bf16" if dist_info.device.type == "cuda" else "fp32"
    return ParallelPlan(sharded=wants_fsdp(p, dist_info.world_size), param_dtype=torch_dtype(mp),
                        reduce_dtype=torch_dtype(p["reduce_dtype"]), reshard_after_forward=p["reshard_after_forward"],
                        replicate=p["replicate"], blocks_per_unit=p["blocks_per_fsdp_unit"],
                        activation_checkpointing=p["activation_checkpointing"], compile=p["compile"])


# ---- applying the plan ---------------------------------------------------------------------------------------
def compute_precision(precision: str, device) -> str:
    """train.precision resolved for a device: auto is bf16 on CUDA (~15x the fp32 GEMM rate), fp32 on CPU."""
    if precision == "auto":
        return "bf16" if torch.device(device).type == "cuda" else "fp32"
    return precision


def autocast(precision: str, device):
    """bf16 autocast for train.precision bf16 (or auto on CUDA), nothing for fp32."""
    if compute_precision(precision, device) == "bf16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _checkpointed(forward):
    from torch.utils.checkpoint import checkpoint

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # sampling / validation: nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    return run


def apply_activation_checkpointing(blocks: nn.ModuleList) -> None:
    """Recompute each block's activations in backward (only the block inputs are kept). The block's `forward`
    is wrapped in place, so parameter names and state dicts are unchanged."""
    for block in blocks:
        block.forward = _checkpointed(block.forward)


def apply_compile(blocks: nn.ModuleList) -> None:
    """torch.compile each block (same-shape blocks share the compiled code); names stay unchanged."""
    for block in blocks:
        block.compile()


def fsdp_mesh(plan: ParallelPlan, device_type: str | None = None):
    """The device mesh FSDP2 shards over: 1-D over every rank (plain FSDP), or for parallel.replicate R > 1 the
    2-D (replicate, shard) mesh of R groups of W / R consecutive ranks (consecutive: the ranks of one node)."""
    from torch.distributed.device_mesh import init_device_mesh

    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    world = dist.get_world_size()
    if plan.replicate == 1:
        return init_device_mesh(device_type, (world,))
    return init_device_mesh(device_type, (plan.replicate, world // plan.replicate),
                            mesh_dim_names=("replicate", "shard"))


def shard_group(t: torch.Tensor):
    """The process group over which a DTensor's rows are split: its mesh's last dim (FSDP2's shard dim; an HSDP
    mesh's first dim holds identical replicas). Sums over a parameter's rows (norms, row statistics) run here."""
    mesh = t.device_mesh
    return mesh.get_group(mesh.ndim - 1)


def fsdp_units(blocks: list, per_unit: int) -> list[list]:
    """The blocks grouped as FSDP2 units: consecutive runs of `per_unit`, the last unit holding the remainder
    (depth 28 by 3: nine units of 3, then one of 1; `per_unit` >= depth: one unit of every block)."""
    blocks = list(blocks)
    return [blocks[i:i + per_unit] for i in range(0, len(blocks), per_unit)]


def apply_fsdp(model: nn.Module, blocks: nn.ModuleList, plan: ParallelPlan, trainable: bool = True,
               mesh=None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = mesh if mesh is not None else fsdp_mesh(plan)

    param = None if plan.param_dtype == torch.float32 else plan.param_dtype
    reduce = None if plan.reduce_dtype == torch.float32 and param is None else plan.reduce_dtype
    policy = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
    units = fsdp_units(blocks, plan.blocks_per_unit)
    for i, unit in enumerate(units):
        # training: the last unit's weights are needed again at once by backward, so keep them gathered.
        # A frozen model (the EMA, no backward) always reshards: its shards change between calls (EMA update).
        # An int reshards to groups of that size: the next gather stays within the group (e.g. a node).
        last = i == len(units) - 1
        after = (not last and plan.reshard_after_forward) if trainable else True
        # a list is one unit (one all-gather, one reduce-scatter); a single block is passed as itself, as before
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, reshard_after_forward=after, mp_policy=policy)
    # The root's inputs stay as given: a bf16 cast would round t (0.9987 -> 1.0, an error of 1.3 on the timestep
    # embedding's 1000-step scale); the model casts the image and text inputs to its compute dtype itself.
    root = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, cast_forward_inputs=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=None if trainable else True, mp_policy=root)


def parallelize(model: nn.Module, plan: ParallelPlan, trainable: bool = True, mesh=None) -> nn.Module:
    """Apply the plan to a DiT (its `blocks`): activation checkpointing and compile to the trained model only,
    then FSDP2 per unit of plan.blocks_per_unit blocks and the root, over `mesh` (default: fsdp_mesh(plan)). A
    frozen model (the EMA) is only sharded."""
    if not trainable:
        model.requires_grad_(False)
    if trainable and plan.activation_checkpointing:
        apply_activation_checkpointing(model.blocks)
    if trainable and plan.compile:
        apply_compile(model.blocks)
    if plan.sharded:
        apply_fsdp(model, model.blocks, plan, trainable, mesh)
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise): what this rank owns and updates."""
    return t.to_local() if hasattr(t, "to_local") else t


def held_shard(t: torch.Tensor) -> torch.Tensor:
    """local(t) for per-step loops outside autograd: the local tensor the DTensor holds, read without dispatching
    an operator. to_local() on a DTensor that is an nn.Parameter returns a fresh view on every call (a dispatched
    view per parameter and step: ~600 per EMA update at dit_15b, ~2 us of host each on a GPU); same memory, no
    autograd link (to_local stays the differentiable path)."""
    return t._local_tensor if hasattr(t, "to_local") else t


@torch.no_grad()
def weights_finite(model: nn.Module) -> bool:
    """Whether every parameter is finite on every rank (one all-reduce of a count; checked before each save)."""
    params = [local(p) for p in model.parameters()]
    bad = torch.zeros(1, device=params[0].device if params else "cpu")
    for p in params:
        if p.numel():
            bad += (~torch.isfinite(p)).any()
    return all_reduce_sum_(bad).item() == 0


@torch.no_grad()
def global_grad_norm(parameters) -> torch.Tensor:
    """The global L2 norm of the gradients, as torch.nn.utils.clip_grad_norm_ computes it (get_total_norm) for
    plain tensors; for FSDP2 shards (every gradient Shard(0) over the one mesh's shard dim) the squared norms of
    the local shards are summed and one all-reduce over the shard group gives the global norm (the replicas of an
    HSDP mesh hold the same gradients: summing over them would count each R times): one scalar of communication."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    if not any(isinstance(p.grad, DTensor) for p in params):
        return torch.nn.utils.get_total_norm([p.grad for p in params])
    norms = torch._foreach_norm([p.grad.to_local() for p in params])
    sq = torch.stack([n.float() for n in norms]).pow(2).sum()
    dist.all_reduce(sq, group=shard_group(params[0].grad))
    return sq.sqrt()


@torch.no_grad()
def clip_grads_(parameters, max_norm: float, total: torch.Tensor) -> None:
    """Scale the gradients as torch.nn.utils.clip_grad_norm_ does, by min(1, max_norm / (total + 1e-6)) with
    `total` from global_grad_norm (FSDP2: the local shards). The trainer calls it only where clip_scaled said the factor
    is below 1: a factor of exactly 1 leaves every gradient bit for bit as it was, so that pass over the gradients
    (a read and a write of each) is skipped, not run."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    if not any(isinstance(p.grad, DTensor) for p in params):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return
    grads = [p.grad.to_local() for p in params]
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].dtype))


def clip_scaled(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Whether clipping changes the gradients (a device bool): clip_grads_' factor, as it computes it, below 1.
    A factor of exactly 1 leaves every gradient bit for bit as it was."""
    return (max_norm / (total + 1e-6)) < 1.0


FAILING_WAIT_S = 10.0  # how long a failing rank waits for its peers to leave: a refusal reaches every rank at once


def shutdown_process_group(failing: BaseException | bool | None = None) -> None:
    """Leave the process group cleanly. Every rank first waits, through the TCP store rather than the backend, until
    all ranks are past their last collective: a gloo rank that tears down while a peer is still finishing the last
    collective can abort that peer ("terminate called without an active exception", ~1 in 30 runs here). Rank 0
    then waits until every other rank is past that wait too: where rank 0 hosts the store (init from MASTER_ADDR,
    as the tests do; torchrun's agent hosts its own), a rank 0 that left first closed the store under a peer still
    reading it ("Connection reset by peer").
    `failing` (the exception on its way out, or True): a peer may be dead or hung and never arrive, so the wait is
    FAILING_WAIT_S, not the store's timeout (parallel.timeout_minutes: a survivor of a killed rank sat that long
    again, then ended in the store's traceback instead of its own one line), and its end is not an error; after a
    CollectiveTimeout (a peer died or hung: it will not come) there is no wait."""
    if not dist.is_initialized():
        return
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if world > 1 and not isinstance(failing, CollectiveTimeout):
            store = dist.distributed_c10d._get_default_store()
            wait = (lambda keys: store.wait(keys, datetime.timedelta(seconds=FAILING_WAIT_S))) if failing else store.wait
            try:
                store.set(f"dit_train/finished/{rank}", "1")
                wait([f"dit_train/finished/{r}" for r in range(world)])
                if rank == 0:
                    wait([f"dit_train/left/{r}" for r in range(1, world)])
                else:
                    store.set(f"dit_train/left/{rank}", "1")
            except RuntimeError:  # DistStoreError/DistNetworkError: the wait ran out, or the store's host is gone
                if not failing:
                    raise
    finally:
        dist.destroy_process_group()
