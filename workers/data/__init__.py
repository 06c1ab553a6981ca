"""Data: tasks (prompts and answers), rewards, tokenizers and model sources."""
