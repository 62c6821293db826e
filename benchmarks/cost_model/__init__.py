"""A cost model of one training step (docs/cost_model.md): forward + backward, FSDP2's collectives and the
optimizer's step, per preset x optimizer (K, RowNorm scale, distributed mode) x world size x hardware profile.
Every input comes from the real code: parameter shapes and FLOPs from the model built on the meta device
(model/flops.py), FSDP2 bytes from comm_volume.fsdp_volumes, and the optimizer step counted op by op on fake tensors
(one process: benchmarks/op_cost.py; W ranks: the real sharded step on a fake process group of W,
benchmarks/sharded_count.py, with the collectives and bytes the optimizer itself issues, in its own order of issues
and waits, replayed by benchmarks/sharded_schedule.py). The first-principles floor (`floor=True`: bytes and FLOPs
per element, the whole-matrix schedule of benchmarks/model_owner_schedule.py) is kept beside it.

    python -m benchmarks.cost_model --paper [--hardware h100|h200]         # the paper's table
    python -m benchmarks.cost_model --measure-host [--save benchmarks/host_profile.json]
    python -m benchmarks.cost_model --calibrate --bench-optimizer LOG --bench-distributed LOG
    python -m benchmarks.cost_model --calibrate-h200                     # forward + backward against the GPU check

One concern per module:
- hardware.py: a hardware profile (Hardware), the H100/H200 data sheets, the H200's calibration (the H100's: the
  H200's with its HBM) and the assumed efficiencies
- shapes.py: the model's shapes (built on the meta device) and the sharded optimizer's logical bytes
- contender.py: a contender (optimizer, K, RowNorm scale, distributed mode) and the configs it is counted with
- floor.py: the first-principles floor of one optimizer step
- sharded.py: the sharded step counted on a fake process group of W and replayed on GPU streams
- compute.py: forward + backward counted from the model on fake tensors and priced per op (GEMM curve, HBM, launch)
- gpu_calibration.py: that term against the three GPU check runs, and the fit of its two parameters
- predict.py: the prediction of one training step, and the GPU check's line
- measure_host.py: this host measured (GEMM, memory, gloo, Python per op), and as a hardware profile
- bench_logs.py: the CPU benchmarks' logs read by row
- calibration.py: predicted against measured on this host
- paper.py: the paper's table
- cli.py: the command line (`python -m benchmarks.cost_model`, __main__.py)
"""
