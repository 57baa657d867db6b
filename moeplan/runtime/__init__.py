"""The executor: a Plan made real on torchrun workers (gloo on CPU, NCCL on GPU).

Entry points: `launch.run` (what `moeplan run` calls: prepares the plan once and writes it,
with `options.RunOptions`, to OUT/run.json), `worker.run_worker` (one rank; reads that file),
`train.Trainer` (one rank's model + optimizer + data, one `step` per global batch),
`groups.build_groups` (process groups from `specs.grid.RankGrid`, the pure rank layout in
Megatron's order), `parallelize.parallelize` (the per-axis `apply_*` steps),
`optimizer.DistributedOptimizer`. Only `launch`, `options`, `support`, `guard`, `lifecycle`,
`scale` and `agent` (until it starts torchrun) are importable without torch.
"""
