"""The vision-language task: a toy VLM on the vision tower and K3-mu."""
