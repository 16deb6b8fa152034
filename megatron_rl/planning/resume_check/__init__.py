"""`megatron-rl resume-check`: a resume rehearsed on metadata, before any rank loads a byte.

    ranks = rehearse(index, trainer)   # index: a checkpoint's (`read_index`) or a job's save (`rehearsed_index`)

For every rank of a trainer (`TrainerSpec`: a model at a layout), it proves that each element of every model and
optimizer tensor the rank loads is in the checkpoint exactly once, and that each object it loads is there (the
layers' `_extra_state`, each directory's `common.pt` and `metadata.json`, `rl_state.pt`); and it counts the bytes
the rank reads, as the loader reads them, and the bytes it needs. The first range in no chunk, or in several, is a
`ResumeCheckError` in one line naming the tensor and the elements.

How, from the job's own pieces (none restated here):
1. What a rank holds: its stage, built on the meta device by the job's builder (`planning.meta.stage_model`), its
   model state dict as saved and loaded (`models.sharding.model_sharded_state_dict`, factories applied), and its
   distributed optimizer's ranges (`planning.meta.owned_ranges`: Megatron-Core's range map over its DDP buffers)
   cut into the model-space boxes the checkpoint stores (`checkpointing.optimizer_state.range_boxes`). Ranks with
   the same (tp, pp) coordinates hold the same model tensors: each stage is built once, and only the optimizer's
   ranges differ over DP. A mixture of experts split over DP ranks is built once per share of the experts (the
   layout's expert grid); the DP ranks holding a share (an expert-data-parallel group) read its weights as the load
   reads what the whole group holds alike, one rank each, and each rank's optimizer owns ranges of the dense
   weights over the DP group and of its experts' over its expert-data-parallel group
   (`planning.meta.owned_expert_ranges`).
2. The checkpoint's index: torch DCP's `Metadata` of `model/` and `optimizer/` (`safe_load.read_dcp_metadata`;
   with `--index-only`, a copy of just the `.metadata` files and `megatron_rl.json` will do; otherwise every file
   the index names must be there with its recorded size, and with `--checksums` its content: `check_files`), or,
   for a job's config, the `Metadata` its
   save writes: every rank's tensors (1.) at the job's layout, each distinct chunk once, as DCP keeps one copy of
   replicated items.
3. Exactly once: each tensor's chunks tile its global shape (`checkpointing.coverage`, the check every load runs),
   and each box a rank needs lies inside that shape with the same global shape (except the vocabulary's padded
   rows, which Megatron-Core lets differ: rows past the saved ones are padding and load as zeros).
4. Bytes read, as `checkpointing/loader.py` reads them: torch DCP's read items for the box
   (`create_read_items_for_chunk_list`), each read as the byte ranges `checkpointing.reads.chunk_read_ranges`
   gives; what every DP rank of a shard holds alike (weights) is read by one rank of the group, chosen per
   directory by `reads.read_owners`, and passed on to the others. The load time is `checkpoint_cost`'s model: a
   checksum pass over every byte written, spread over the trainer's nodes, then the busiest node's reads, both at
   the calibration's filesystem read rate. Only tensor bytes are counted (not the chunks' headers, nor objects).

This is planning, not a checkpointing component: it builds stages on the meta device and reads job configs, which
a component may not import. `train` runs it before a resume loads anything (`check_resume`, from
`controller/job.py`), `megatron-rl resume-check` (`run`) from the command line.

The package, by concept (`megatron-rl resume-check` starts at `command.run`; `train` at `in_train.check_resume`):

- `stages.py`: the trainer layout (`TrainerSpec`) and what each of its ranks holds (`Stage`, `build_stage`, `stages`).
- `index.py`: the checkpoint's index (`Index`, `read_index`), the trainer it was saved at, the synthetic save of a
  layout (`rehearsed_index`), and the files the load reads, checked against it (`check_files`: the first byte read).
- `rehearsal.py`: each rank's load matched against the index (`rehearse`), the bytes read, the report.
- `in_train.py`: the check `train` runs before a resume loads anything (`check_resume`).
- `command.py`: the command (`run`): its trainer, its checks in order, text or JSON; `progress.py` its progress lines.

From `megatron-rl resume-check CKPT` to the first byte read, by name: `cli.cmd_resume_check` -> `command.run` ->
`index.read_index` -> `checkpointing.layout.read_meta` (the checkpoint's `megatron_rl.json`, the first file read);
then the trainer it was saved at (`index.saved_trainer`), whose `Index.tensors` reads `model/.metadata` and
`optimizer/.metadata` (`Index.metadata` -> `checkpointing.safe_load.read_dcp_metadata`); then `index.check_files`
(a stat per file the load opens; with `--checksums`, their bytes) and `rehearsal.rehearse` for each stage. No
shard's bytes are read without `--checksums`.
"""

from megatron_rl.planning.resume_check.command import run
from megatron_rl.planning.resume_check.in_train import check_resume
from megatron_rl.planning.resume_check.index import Index, check_files, read_index, rehearsed_index
from megatron_rl.planning.resume_check.rehearsal import RankBytes, rehearse, report
from megatron_rl.planning.resume_check.stages import ResumeCheckError, TrainerSpec

__all__ = ["Index", "RankBytes", "ResumeCheckError", "TrainerSpec", "check_files", "check_resume", "read_index",
           "rehearse", "rehearsed_index", "report", "run"]
