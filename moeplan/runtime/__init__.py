"""The executor: a Plan made real on torchrun workers (gloo on CPU, NCCL on GPU).

Entry points: `launch.run` (what `moeplan run` calls), `worker.run_worker` (one rank),
`train.Trainer` (one rank's model + optimizer + data, one `step` per global batch),
`grid.RankGrid` (pure rank layout, Megatron's order), `parallelize.build_groups` /
`parallelize.parallelize` (groups and per-axis sharding), `optimizer.DistributedOptimizer`.
Only `grid`, `launch`, `support`, `guard`, `lifecycle`, `scale` and `agent` (until it
starts torchrun) are importable without torch.
"""
