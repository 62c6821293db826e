"""Environment variables the process groups read, set before they are created where the user has not set them
(docs/scaling_out.md, "When a rank dies or hangs" and "Multi-node: the gloo group's network interface").

- TORCH_NCCL_ASYNC_ERROR_HANDLING=3: a collective that outlives parallel.timeout_minutes takes the process down
  (SIGABRT) without trying to abort the communicators, which can hang on a broken network. It is torch's own
  default, set explicitly so that a run started by srun alone behaves as documented; torchrun sets 1 (abort the
  communicators first, then the process) for its workers, which is kept. The deprecated spelling
  NCCL_ASYNC_ERROR_HANDLING (and NCCL_BLOCKING_WAIT, NCCL_DESYNC_DEBUG) is moved to the current name, its value
  kept: torch warns about the old one on every rank.
- The flight recorder: the last TORCH_FR_BUFFER_SIZE collectives of every rank, written on a timeout
  (TORCH_NCCL_DUMP_ON_TIMEOUT) to TORCH_FR_DUMP_TEMP_FILE<rank>, which `record_nccl_traces` points into the run
  folder once it is known (torch opens the file at the first dump). `torchfrtrace <folder>` then says which
  collective which rank was stuck in.
- GLOO_SOCKET_IFNAME: a gloo group (the default group on CPU, the asynchronous checkpoints' own group on GPU) binds
  to the address this host's name resolves to unless told an interface, and on many hosts that name resolves to
  127.0.1.1 (Debian's /etc/hosts), which no other node can reach. `use_gloo_interface` names the interface this
  host reaches MASTER_ADDR through (the first node itself: the interface that holds MASTER_ADDR's address).
  One the user set, like NCCL_SOCKET_IFNAME, must name an interface of this host (`check_socket_interfaces`):
  otherwise every rank stopped in the backend's traceback ("Unable to find address for: eth9").
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

import torch.distributed as dist

log = logging.getLogger("dit_train")
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's (first) IPv4 address

# deprecated spelling -> current name (torch warns about the old ones on every rank)
RENAMED = {"NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
           "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT", "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG"}
# current name -> the older name torch also reads: a user's setting under either is kept
OLDER_NAME = {"TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
              "TORCH_FR_DUMP_TEMP_FILE": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
NCCL_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                 "TORCH_FR_BUFFER_SIZE": "2000"}
TRACE_FOLDER = "nccl_traces"


def _is_set(environ, name: str) -> bool:
    return name in environ or OLDER_NAME.get(name, name) in environ


def use_nccl_environment(environ=os.environ) -> None:
    """Before the NCCL group is created: the deprecated spellings renamed (values kept; a current name already set
    wins, as in torch), then NCCL_DEFAULTS for what no spelling sets; a NCCL_SOCKET_IFNAME naming no interface here
    is refused (ValueError, one line)."""
    check_socket_interfaces(environ, ("NCCL_SOCKET_IFNAME",))
    for old, current in RENAMED.items():
        if old in environ:
            environ.setdefault(current, environ.pop(old))
    for name, value in NCCL_DEFAULTS.items():
        if not _is_set(environ, name):
            environ[name] = value


def record_nccl_traces(run_dir: str, environ=os.environ) -> None:
    """Every rank, once the run folder is agreed: an NCCL group's flight-recorder dumps go to
    run_dir/nccl_traces/rank_<rank> (unless the user chose a place). Nothing for other backends."""
    if not dist.is_initialized() or dist.get_backend() != "nccl" or _is_set(environ, "TORCH_FR_DUMP_TEMP_FILE"):
        return
    folder = os.path.join(run_dir, TRACE_FOLDER)
    os.makedirs(folder, exist_ok=True)
    environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(folder, "rank_")


def check_socket_interfaces(environ=os.environ, names=("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")) -> None:
    """ValueError (one line naming the variable and this host's interfaces) where a user-set GLOO_SOCKET_IFNAME
    names an interface this host does not have (gloo takes a comma-separated list of exact names), or
    NCCL_SOCKET_IFNAME matches none (NCCL's list of name prefixes, `=name` exact; an `^exclusion` list is not
    checked). Each rank stopped in the backend's traceback instead (gloo: "Unable to find address for: eth9")."""
    here = [name for _, name in socket.if_nameindex()]
    for var in names:
        value = environ.get(var, "")
        if not value or value.startswith("^"):  # unset or empty (the backend's own choice), or an exclusion list
            continue
        if var == "GLOO_SOCKET_IFNAME":
            missing = [n for n in value.split(",") if n not in here]
        else:
            exact, wanted = value.startswith("="), value.lstrip("=").split(",")
            missing = [] if any(n == w if exact else n.startswith(w) for w in wanted for n in here) else wanted
        if missing:
            named = "named" if var == "GLOO_SOCKET_IFNAME" or value.startswith("=") else "whose name starts with"
            raise ValueError(f"{var}={value}: this host ({socket.gethostname()}) has no network interface {named} "
                             f"{' or '.join(missing)}; its interfaces: {', '.join(here)} (set {var} to one of them, "
                             f"or unset it)")


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:  # no IPv4 address
            return None
    return socket.inet_ntoa(packed[20:24])


def source_address(host: str) -> str:
    """The local IPv4 address this host sends from to reach `host` (the routing table's choice: a UDP socket
    'connected' to it, no packet sent). ValueError, one line, when `host` has no IPv4 address."""
    try:
        target = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    except OSError as e:
        raise ValueError(f"MASTER_ADDR={host} has no IPv4 address here ({e.strerror or e}): set MASTER_ADDR to the "
                         "first node's address, or GLOO_SOCKET_IFNAME to this node's network interface") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((target, 9))
        return s.getsockname()[0]


def interface_with(address: str) -> str | None:
    """The interface holding IPv4 `address` (a loopback address: the loopback interface); None if none does."""
    loopback = ipaddress.ip_address(address).is_loopback
    for _, name in socket.if_nameindex():
        own = _ipv4_of(name)
        if own is not None and (own == address or (loopback and ipaddress.ip_address(own).is_loopback)):
            return name
    return None


def spans_nodes(environ) -> bool:
    """Whether the job's ranks are on more than one host, as far as the launcher says (torchrun: LOCAL_WORLD_SIZE
    < WORLD_SIZE; srun: SLURM_STEP_NUM_NODES > 1)."""
    world = int(environ.get("WORLD_SIZE", "1"))
    return (int(environ.get("LOCAL_WORLD_SIZE", world)) < world
            or int(environ.get("SLURM_STEP_NUM_NODES") or 1) > 1)


def use_gloo_interface(environ=os.environ) -> None:
    """Before a gloo group of a multi-process job (a CPU job's default group, init_distributed; an NCCL job's async
    checkpoint group, CheckpointSaver): GLOO_SOCKET_IFNAME = the interface that reaches MASTER_ADDR, unless set. ValueError (one line) where that is the loopback interface on a job that spans nodes (the first
    node, whose name resolves to 127.x here): no other node could reach it."""
    master = environ.get("MASTER_ADDR")
    if "GLOO_SOCKET_IFNAME" in environ:  # the user's choice, if it names an interface here
        check_socket_interfaces(environ, ("GLOO_SOCKET_IFNAME",))
        return
    if not master:
        return
    source = source_address(master)
    if ipaddress.ip_address(source).is_loopback and spans_nodes(environ):
        raise ValueError(f"MASTER_ADDR={master} is reached through the loopback interface here ({source}), which the "
                         "other nodes cannot reach: set GLOO_SOCKET_IFNAME to this node's cluster network interface "
                         "(`ip -brief address` lists them), or MASTER_ADDR to the first node's address on it")
    name = interface_with(source)
    if name is None:  # a secondary address: leave gloo's own choice (the host name's address)
        log.warning("no interface holds %s (the address that reaches MASTER_ADDR=%s) as its first IPv4 address; "
                    "gloo binds to the host name's address: set GLOO_SOCKET_IFNAME if other nodes cannot reach it",
                    source, master)
        return
    environ["GLOO_SOCKET_IFNAME"] = name
