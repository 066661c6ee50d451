#!/usr/bin/env bash
# Install eagle-panel and its ML stack into a virtual environment.
#
#   scripts/install.sh            panel + stages (torch, transformers, speculators 0.9)
#   scripts/install.sh --dev      the same plus the test tools
#   VENV=/path scripts/install.sh another venv (default: .venv beside this repo)
#
# speculators 0.9 declares torchvision and torchaudio but imports neither, and
# torchaudio would replace a CPU torch with a multi-GB CUDA one: it is
# installed --no-deps and its real needs come from the `ml` extra. A torch
# that is already installed (a GPU server's) is kept; otherwise the CPU build
# torch==2.13.0 is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
extras="ml"
[ "${1:-}" = "--dev" ] && extras="ml,dev"

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
pip() { "$PY" -m pip --disable-pip-version-check -q "$@"; }

if "$PY" -c "import torch" 2>/dev/null; then
  echo "keeping the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  pip install "torch==2.13.0"
fi
pip install --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
pip install -e ".[$extras]"
echo "(pip's note that speculators requires torchaudio/torchvision is expected: it imports neither)"
"$PY" -c "import torch, speculators, transformers, textual; print('eagle-panel installed: torch', torch.__version__, '| transformers', transformers.__version__, '| speculators', speculators.__version__ if hasattr(speculators, '__version__') else '0.9')"
