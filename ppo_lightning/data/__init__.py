"""Data: records read from files or datasets with their metadata columns (``records.py``), and
prompts rendered, tokenised and batched for PPO (``prompts.py``). ``toy_prompts.txt`` is the
package's own prompt file (``data=toy``)."""
