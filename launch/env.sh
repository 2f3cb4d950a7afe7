# Sourced by the launch scripts that run ood-jax from a checkout (the current directory):
# `ood_jax_env CONFIG` checks that the config file is there, activates VENV (default ./.venv)
# when it exists, and checks that ood-jax is on PATH. Sets `venv`.

ood_jax_env() {
    local config=$1
    if [[ ! -f ${config%%:*} ]]; then
        echo "error: config file ${config%%:*} not found under $PWD" >&2
        exit 2
    fi
    venv=${VENV:-$PWD/.venv}
    if [[ -f $venv/bin/activate ]]; then
        # shellcheck disable=SC1091
        . "$venv/bin/activate"
    fi
    command -v ood-jax >/dev/null || {
        echo "error: ood-jax not on PATH (set VENV or install the package)" >&2
        exit 1
    }
}
