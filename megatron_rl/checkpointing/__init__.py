"""Checkpoints: training checkpoints (sharded, reshardable, written in the background), conversion between Hugging
Face models and Megatron-Core distributed checkpoints, and `inspect`.

layout           the on-disk format, and the only code that reads or writes it: names, `megatron_rl.json`
                 (`read_meta` / `write_meta`), the manifest and `verify`, a run's step directories, `latest`,
                 removing unfinished writes; the errors that name a bad checkpoint
training         `TrainCheckpointer`: save (in the background), find, load
megatron_state   the sharded state dicts handed to Megatron-Core's dist_checkpointing, and its workarounds
optimizer_state  the distributed optimizer's state in model space, written in pieces
rng              the per-rank RNG states
background       the background write: host staging, planned writes, the ranks' markers
storage          what to say when the filesystem refuses a save; whether the saves fit
safe_load        reading pickled checkpoint files without running code
initial          the weights a job starts from (`model.checkpoint`)
tokenizer        the tokenizer that travels with a checkpoint
hf_sources       what a Hugging Face source (directory or GGUF) holds, before any weight is read
convert          HF <-> Megatron conversion: the command; hf_to_megatron and megatron_to_hf, its two directions;
                 destination, what --overwrite may replace and the memory used (GGUF files: formats/gguf.py)
safetensors_io   the streaming safetensors writer and header reader
inspect          `megatron-rl inspect`: what a checkpoint holds, from its metadata
settings         the `checkpoint:` section of a job
model_section    the `model:` section: a preset, or a checkpoint whose recorded shape is the model's
"""
