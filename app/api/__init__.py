"""The OpenAI API: request parsing and response shapes (schemas), prompt building, and one chat
completion end to end (chat), independent of Ray."""
