"""ALFWorld's part of the prompt: its role line, and the engine command the agent never sees."""

ROLE_LINE = "You are an expert agent operating in the ALFRED Embodied Environment."

# "help" is admissible to the engine but only prints the command list: the reference hides it from the agent.
# (env_servers/alfworld_env.py drops it from its reports too; a list straight from the engine reads the same.)
HIDDEN_ACTIONS = frozenset({"help"})
