"""Training methods: how a batch of the task's data becomes a loss. `sft`
is the causal-LM task's own next-token loss (finetune/tasks/causal_lm.py);
the preference methods (preference.py) score chosen against rejected
completions, with a frozen reference where the method needs one."""
