"""The first compiled RowNorm step's time (its passes' cold compile) and a warm step's, against the matrices per
compiled call: dit_15b's shapes at width 64 (2 heads), depth D (D matrices per bucket of a per-block shape),
optimizer rownorm with compile_rownorm=true, one thread, on CPU (inductor's C++). One process per measurement with a
new, empty inductor cache; inductor's one-off start-up (its first compile of anything) is timed apart.

    for D in 8 16 32; do for C in 0 8; do d=$(mktemp -d); TORCHINDUCTOR_CACHE_DIR=$d \
        python -m benchmarks.rownorm_compile_cost $D $C; rm -rf $d; done; done

C: fused_rownorm.MAX_MATRICES_PER_CALL (0: one call per bucket, as before chunking). docs/bench_optimizer.md,
"Compile cost", holds the results."""

import json
import sys
import time

import torch


def main(depth: int, chunk: int) -> dict:
    from dit_train.model.dit import build_model, load_preset
    from dit_train.optim import fused_rownorm
    from dit_train.optim.registry import build_optimizer

    torch.set_num_threads(1)
    fused_rownorm.MAX_MATRICES_PER_CALL = chunk or None
    t0 = time.monotonic()
    torch.compile(lambda a: a * 2 + 1)(torch.ones(4))
    startup = time.monotonic() - t0
    model = build_model(load_preset("dit_15b", hidden_size=64, depth=depth, num_heads=2))
    opt = build_optimizer(model, {"name": "rownorm", "compile_rownorm": True, "rownorm_scale": "frobenius"})
    gen = torch.Generator().manual_seed(0)

    def step() -> float:
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        t = time.perf_counter()
        opt.step()
        return time.perf_counter() - t

    first = step()
    warm = sorted(step() for _ in range(21))[10]  # the median
    return {"depth": depth, "chunk": chunk, "startup_s": round(startup, 2), "first_step_s": round(first, 2),
            "warm_step_ms": round(warm * 1e3, 2), "compiled_variants": len(fused_rownorm._compiled)}


if __name__ == "__main__":
    if len(sys.argv) != 3 or not all(a.isdigit() for a in sys.argv[1:]):
        from dit_train.plain_text import print_error

        print_error(f"arguments {sys.argv[1:]} are not valid; give DEPTH CHUNK, two integers (CHUNK 0: unchunked)")
        sys.exit(2)
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))), flush=True)
