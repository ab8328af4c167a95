"""The networks: the causal LM with its value head (``policy.py``), LoRA adapters through peft
(``lora.py``), the lean LM head that never holds a whole minibatch's logits (``lean_head.py``),
each prompt encoded once per group (``shared_prompt.py``), what a model's forward accepts
(``signature.py``), and the tiny offline models and tokenizers tests and demos build (``tiny.py``)."""
