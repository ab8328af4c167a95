"""The networks: the causal LM with its value head (``policy.py``), LoRA adapters through peft
(``lora.py``), the lean LM head that never holds a whole minibatch's logits (``lean_head.py``), and
the tiny offline models and tokenizers tests and demos build (``tiny.py``)."""
