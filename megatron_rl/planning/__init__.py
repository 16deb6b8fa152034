"""`megatron-rl plan`: memory per rank, weight-sync time and step time of a job, before it starts.

meta         one rank's modules built on the meta device by the job's own builders; Megatron-Core's DDP buffers
             and distributed-optimizer shards over them (exact bytes, no allocation)
memory       the stated models for what is not a parameter: activations, generator workspace
steptime     one RL step, synchronous (colocated baseline) and asynchronous (dedicated executors)
calibration  per-device rates from a YAML file whose every number names its source (`h100.yaml`)
checkpoint   whether a checkpoint reshards into the trainer layout, from its metadata
resume_check `megatron-rl resume-check`: every element each rank of a layout loads, in a checkpoint (or a job's
             rehearsed save) exactly once, and the bytes each reads; `train` runs it before a resume loads
plan         `make_plan(cfg, model, calibration)`: all of the above for one job
report       the readable report
paper        the LlamaRL paper's step-time table, predicted (validation)

Importing this package imports nothing heavy; torch and Megatron-Core load when a plan is made.
"""
