"""The serving policy: where replicas go and when they take traffic, kept apart from Ray so it can be tested.

`placement` (GPUs, bundles, tensor-parallel groups), `cluster` (per-node floors), `routing` and
`replica_stats` (which replica gets a request), `autoscaling` (the policy Serve calls), `warmup` and
`readiness` (ready means warm), `shutdown` (how long a stopped replica finishes its answers), `fused` (the
tower and engine in one replica), `tensor_parallel` (a rank's side of a lockstep group) and `local_backend`
(the whole pipeline in one process, the tests' reference).
"""
