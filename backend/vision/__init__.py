"""Vision inputs (issue 15, in progress): the language model's side of a vision-language model."""
