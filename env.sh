# Environment for running tests and tools by hand (the Makefile exports the same): this machine's choices.
# What the project needs (vLLM's, DeepSpeed's, the tokenizers' variables) it sets itself: common/processes/process_env.py.
export DS_BUILD_OPS=0 HF_HUB_OFFLINE=1
export TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions" ALFWORLD_DATA="$PWD/data/alfworld" WEBSHOP_DATA="$PWD/data/webshop" GIGPO_MODELS="$PWD/data/models"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
