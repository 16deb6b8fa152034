"""The single controller: one torch.distributed world split into executors, the RL loop every rank walks, and the
command that starts it. Read `loop.py` first.

train      `megatron-rl train`: a resolved config to `loop.run` on every rank, for local ranks and for a world
           started by torchrun/srun (one sequence: world, banner, lock, run directory, ranks, summary)
rank       what every rank runs: build its `Job`, run the loop, return rank 0's result
rundir     a run's directory: where it is, checked against the job before anything is written, prepared
summary    summary.json and the plot of a finished or stopped run, and the command's exit code
requeue    the end of a SLURM allocation: its one line, and whether the job goes back in the queue
loop       the RL loop, top to bottom: generate, score, advantages, AIPO step, push, metrics, checkpoint
schedule   the whole run written down as data: which batch with which weight version, when weights move
job        one rank of the job: its place in the world, its executors, the collectives that span them
executors  what a rank builds: trainer, generator, weight push, reward-model executor
live_batches  the generator's training batches in its live engine (rollout.in_flight), and their checkpoint
scoring    every reward a sample gets (verifiers, user functions, a reward model) and the messages that carry them
collector  rank 0's bookkeeping: scored rollouts in, batches with advantages and metric rows out
tasks      what the job learns: prompts, how a prompt is shown, its reward
channels   control-plane messages between executors (pickled objects over gloo point-to-point)
metrics    metrics.jsonl, TensorBoard, W&B, the plot; the watches that warn of a run that cannot learn
"""
