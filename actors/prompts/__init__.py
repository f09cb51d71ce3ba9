"""The text the policy sees and the action it answers with, apart from the rollout loop: `shared.py` (the step
prompt, the response format and its parsing, the constrained-generation grammar), and one module per
environment (`alfworld.py`, `webshop.py`) for what differs between them."""
