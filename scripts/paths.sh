# Where setup puts things, shared by the setup script, the Makefile and CI.
# Override any of these in the environment; the build scripts read the same variables.
: "${STRATA_CACHE:=$HOME/.cache/strata}"
MLX_VERSION=0.32.2
MLXC_VERSION=0.7.0
# The MLX wheel we build and link against: mlx-metal on macOS, mlx-cpu elsewhere. (An NVIDIA
# machine builds against mlx-cpu too and swaps in the mlx-cuda-13 libmlx at run time: README.)
case "$(uname -s)" in
  Darwin) MLX_WHEEL=mlx-metal ;;
  *) MLX_WHEEL=mlx-cpu ;;
esac
: "${STRATA_MLX_DIR:=$STRATA_CACHE/$MLX_WHEEL-$MLX_VERSION/mlx}"
: "${STRATA_MLXC_DIR:=$STRATA_CACHE/mlx-c-$MLXC_VERSION}"
: "${STRATA_MODELS:=$STRATA_CACHE/models}"
: "${STRATA_VENV:=$STRATA_CACHE/venv}"
SMOLLM2_FILE=smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
MINILM_DIR=all-minilm-l6-v2
export STRATA_CACHE STRATA_MLX_DIR STRATA_MLXC_DIR STRATA_MODELS STRATA_VENV
