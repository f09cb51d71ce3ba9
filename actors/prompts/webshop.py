"""WebShop's part of the prompt: its role line, and the free-text slot of its search action.

WebShop lists "search[<your query>]" on the search page, whose query the agent writes. Constrained generation
fixes the slot's shape, never its words: lower-case letters, digits, spaces and the punctuation of product
text (no brackets, which end the action, and no < or >, which would start a tag), starting with a letter or
digit, at most FREE_TEXT_MAX_CHARS characters."""

ROLE_LINE = "You are an expert autonomous agent operating in the WebShop e-commerce platform."

FREE_TEXT_SLOT = "<your query>"
FREE_TEXT_CHARS = "a-z0-9 ,.:'&-"
FREE_TEXT_MAX_CHARS = 160
FREE_TEXT = rf"[a-z0-9][{FREE_TEXT_CHARS}]{{0,{FREE_TEXT_MAX_CHARS - 1}}}"    # the regex of a filled slot
