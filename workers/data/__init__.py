"""Data: tasks (prompts and answers), tokenizers and model sources."""
