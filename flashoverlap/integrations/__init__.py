"""Drop-in integrations with frameworks' own tensor parallelism: Hugging Face transformers
(:mod:`.hf`), torch.compile (:mod:`.compile_pass`) and Megatron-Core (:mod:`.megatron`). Each
imports its framework only when used."""
