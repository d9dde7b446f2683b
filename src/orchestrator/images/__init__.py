"""Image prompts of vision-language models: rendering, tiling, and the images of each packed row."""
