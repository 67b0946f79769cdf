"""ReDrafter's recurrent draft head: the module, its distillation data and its training."""
