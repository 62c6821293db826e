"""What one DiT block dispatches in forward and backward, operator by operator, with its Python and module calls:
the per-block host work that larger FSDP2 units do not touch (issue 31 item 4; docs/host_overhead.md).

    python -m benchmarks.block_ops [--preset dit_15b] [--micro-batch 32] [--top 30] [--json out.json] [key=value]
    python -m benchmarks.block_ops --compare before.json after.json      # two saved runs side by side

One DiTBlock of the preset as FSDP2 runs it inside the model: bf16 parameters (mixed precision's gathered copies,
leaves that require grad), the [B, N, D] tokens and the [B, D] conditioning vector requiring grad (their gradients
flow on to the previous block and the embedders), forward then backward from a given output gradient. No FSDP2:
its per-unit work is benchmarks/host_overhead.py's. One warm-up pass first, then:
  operators      at full size on fake CPU tensors (dispatch_counter.FakeDispatchCounter: the operators real tensors
                 dispatch, tests/unit/test_dispatch_counter.py), by name and kind (kernel: device work; view:
                 views and allocations), forward and backward apart;
  Python calls   the same block with 4 channels per head and one image of 2 x 2 patches, on real tensors, under
                 sys.setprofile: every Python function call, and the module calls (nn.Module._call_impl) among them;
  thread us      that tiny block's forward + backward thread CPU time, median of --repeats: rough on a loaded host.
The forward runs under bf16 autocast on the CPU (--precision bf16, the scaling study's train.precision), as the
fake step of host_overhead.py does. The operators are the CPU's: on CUDA, F.rms_norm (qk-norm) is one fused kernel
each way (_fused_rms_norm) where the CPU decomposes it (one F.rms_norm is counted on its own, and the block's norms'
share is shown); CUDA's autocast runs layer_norm and rms_norm in fp32 (a cast in, and one back before the next
projection or the attention: not counted here) where the CPU's runs them in bf16; scaled_dot_product_attention is
one call each way on both.
key=value: model keys over the preset (qk_norm=false, swiglu=true, text_dim=...).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import Counter

PASSES = ("forward", "backward")


def block_and_inputs(preset: str, micro_batch: int, tiny: bool, overrides=()):
    """(block, x, c, grad_out) for one block of `preset`: bf16 parameters that require grad, inputs that do;
    tiny: 4 channels per head, one image of 2 x 2 patches. Call inside the tensor mode to count in."""
    import torch
    from omegaconf import OmegaConf

    from dit_train.model.dit import DiTBlock, DiTConfig, load_preset

    cfg = OmegaConf.merge(load_preset(preset), OmegaConf.from_dotlist(list(overrides)))
    if tiny:
        cfg.hidden_size, cfg.image_size, micro_batch = 4 * cfg.num_heads, 2 * cfg.patch_size, 1
    mc = DiTConfig.from_cfg(cfg)
    with torch.device("meta"):
        block = DiTBlock(mc)
    for module in block.modules():  # swapped in: to_empty and .to cannot turn meta parameters into fake ones
        for name, p in list(module.named_parameters(recurse=False)):
            values = torch.empty(p.shape, dtype=torch.bfloat16).normal_(0, 0.02)  # values: the tiny real run's
            setattr(module, name, torch.nn.Parameter(values))
    tokens = (mc.image_size // mc.patch_size) ** 2
    shape = (micro_batch, tokens, mc.hidden_size)
    x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    c = torch.randn(micro_batch, mc.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    return block, x, c, torch.randn(shape, dtype=torch.bfloat16)


def one_pass(block, x, c, grad_out, mark, autocast: bool) -> None:
    """Forward (under bf16 autocast if `autocast`, as the trainer runs it with train.precision=bf16) and backward of
    the block, each inside mark(name)."""
    import torch

    block.zero_grad(set_to_none=True)
    x.grad = c.grad = None
    with mark("forward"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = block(x, c)
    with mark("backward"):
        out.backward(grad_out)


def count_operators(preset: str, micro_batch: int, autocast: bool, overrides=()) -> dict:
    """{"ops": {pass: {op name: calls}}, "kinds": {op name: kind}, "rms_norm": {pass: {op name: calls}} of one
    F.rms_norm on its own, "rms_norms": the block's RMS norms}."""
    import torch
    import torch.nn.functional as F

    from benchmarks.dispatch_counter import FakeDispatchCounter
    from dit_train.model.dit import RMSNorm

    counter = FakeDispatchCounter(allow_non_fake_inputs=True)
    with counter:
        block, x, c, grad_out = block_and_inputs(preset, micro_batch, False, overrides)
        one_pass(block, x, c, grad_out, counter.phase, autocast)  # warm-up
        counter.reset()
        one_pass(block, x, c, grad_out, counter.phase, autocast)
        ops = {name: dict(counter.ops.get(name, {})) for name in PASSES}
        kinds = dict(counter.kinds)
        norms = [m for m in block.modules() if isinstance(m, RMSNorm)]
        rms = {}
        if norms:  # one qk-norm as the block runs it: [B, N, H, hd] rows of a q/k/v projection
            counter.reset()
            q = torch.randn(micro_batch, 4, 3, 2, 8, dtype=torch.bfloat16).unbind(2)[0].detach().requires_grad_()
            w = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
            with counter.phase("forward"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = F.rms_norm(q, (8,), w, 1e-6)
            with counter.phase("backward"):
                out.backward(torch.ones(out.shape, dtype=torch.bfloat16))
            rms = {name: dict(counter.ops.get(name, {})) for name in PASSES}
            kinds.update(counter.kinds)
    return {"ops": ops, "kinds": kinds, "rms_norm": rms, "rms_norms": len(norms)}


def count_python_calls(preset: str, repeats: int, autocast: bool, overrides=()) -> dict:
    """Python function calls and module calls per pass of the tiny block, and its median thread microseconds."""
    block, x, c, grad_out = block_and_inputs(preset, 1, True, overrides)
    calls, modules, where, current = Counter(), Counter(), Counter(), ["none"]

    @contextlib.contextmanager
    def mark(name):
        current[0] = name
        try:
            yield
        finally:
            current[0] = "none"

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            calls[current[0]] += 1
            where[(current[0], f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}")] += 1
            modules[current[0]] += code.co_name == "_call_impl"

    one_pass(block, x, c, grad_out, mark, autocast)  # warm-up
    sys.setprofile(profile)
    try:
        one_pass(block, x, c, grad_out, mark, autocast)
    finally:
        sys.setprofile(None)
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        one_pass(block, x, c, grad_out, lambda name: contextlib.nullcontext(), autocast)
        times.append((time.thread_time() - start) * 1e6)
    return {"python_calls": {p: calls[p] for p in PASSES}, "module_calls": {p: modules[p] for p in PASSES},
            "python_where": {f"{p} {name}": n for (p, name), n in where.most_common() if p in PASSES},
            "thread_us": statistics.median(times)}


def measure(preset: str, micro_batch: int, repeats: int, autocast: bool, overrides=()) -> dict:
    import torch

    torch.set_num_threads(1)
    return {"preset": preset, "micro_batch": micro_batch, "autocast": autocast, "overrides": list(overrides),
            **count_operators(preset, micro_batch, autocast, overrides),
            **count_python_calls(preset, repeats, autocast, overrides)}


def by_kind(ops: dict, kinds: dict) -> Counter:
    out = Counter()
    for op, n in ops.items():
        out["view" if kinds[op] == "no_kernel" else "kernel"] += n
    return out


def totals(r: dict) -> dict:
    """{pass: {"kernel", "view", "rms_kernel", "rms_view"}}: as counted, and the part of it that is the block's RMS
    norms' CPU decomposition (on CUDA: one fused kernel each way instead; autocast runs it in fp32 there)."""
    out = {}
    for p in PASSES:
        t = by_kind(r["ops"][p], r["kinds"])
        rms = by_kind(r["rms_norm"].get(p, {}), r["kinds"])
        t["rms_kernel"], t["rms_view"] = r["rms_norms"] * rms["kernel"], r["rms_norms"] * rms["view"]
        out[p] = t
    return out


def summary_rows(r: dict) -> list[tuple[str, str]]:
    t = totals(r)
    both = lambda key: " / ".join(str(t[p][key]) for p in PASSES)  # noqa: E731
    return [("kernels (forward / backward)", both("kernel")), ("views and allocations", both("view")),
            (f"of which the {r['rms_norms']} RMS norms' CPU decomposition: kernels", both("rms_kernel")),
            ("of which the RMS norms' CPU decomposition: views", both("rms_view")),
            ("Python calls", " / ".join(str(r["python_calls"][p]) for p in PASSES)),
            ("module calls", " / ".join(str(r["module_calls"][p]) for p in PASSES)),
            ("tiny block thread us (forward + backward; rough)", f"{r['thread_us']:.0f}")]


def op_rows(r: dict, names) -> list[str]:
    rms = r["rms_norm"]
    return [f"| {op} | {'view' if r['kinds'][op] == 'no_kernel' else 'kernel'} | {r['ops']['forward'].get(op, 0)} "
            f"| {r['ops']['backward'].get(op, 0)} | {rms.get('forward', {}).get(op, 0)} "
            f"| {rms.get('backward', {}).get(op, 0)} |" for op in names]


def report(r: dict, top: int) -> str:
    precision = "bf16 autocast" if r["autocast"] else "fp32"
    lines = [f"one {r['preset']} block, {r['micro_batch']} images, {precision} {' '.join(r['overrides'])}".rstrip(), "",
             "| per block | count |", "| --- | ---: |"]
    lines += [f"| {k} | {v} |" for k, v in summary_rows(r)]
    names = sorted(set(r["ops"]["forward"]) | set(r["ops"]["backward"]),
                   key=lambda op: (-(r["ops"]["forward"].get(op, 0) + r["ops"]["backward"].get(op, 0)), op))
    lines += ["", "| operator | kind | forward | backward | of which one RMS norm (CPU), forward | backward |",
              "| --- | --- | ---: | ---: | ---: | ---: |", *op_rows(r, names[:top]),
              "", "Python calls by function (most first):", ""]
    lines += [f"  {n:4d}  {where}" for where, n in list(r["python_where"].items())[:top]]
    return "\n".join(lines)


def compare(before: dict, after: dict) -> str:
    lines = ["| per block | before | after |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {b} | {a} |" for (k, b), (_, a) in zip(summary_rows(before), summary_rows(after))]
    lines += ["", "operators whose count changed:", "",
              "| operator | forward before | after | backward before | after |", "| --- | ---: | ---: | ---: | ---: |"]
    for op in sorted(set().union(*(r["ops"][p] for r in (before, after) for p in PASSES))):
        cells = [r["ops"][p].get(op, 0) for p in PASSES for r in (before, after)]
        if cells[0] != cells[1] or cells[2] != cells[3]:
            lines.append(f"| {op} | {' | '.join(map(str, cells))} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="dit_15b")
    p.add_argument("--micro-batch", type=int, default=32, help="images per rank (dit_15b on 32 GPUs: 32)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="train.precision: bf16 runs the forward under bf16 autocast, as the scaling study trains")
    p.add_argument("--repeats", type=int, default=21, help="timed passes of the tiny block")
    p.add_argument("--top", type=int, default=30, help="operators and Python functions listed")
    p.add_argument("--json", help="also write the measurement to this file")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="print two saved measurements side by side")
    p.add_argument("overrides", nargs="*", help="model keys over the preset, e.g. qk_norm=false swiglu=true")
    args = p.parse_args(argv)
    if args.compare:
        runs = []
        for path in args.compare:
            with open(path) as f:
                runs.append(json.load(f))
        print(compare(*runs))
        return 0
    if args.micro_batch < 1 or args.repeats < 1:
        p.error("--micro-batch and --repeats must be >= 1")
    r = measure(args.preset, args.micro_batch, args.repeats, args.precision == "bf16", args.overrides)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f)
    print(report(r, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
