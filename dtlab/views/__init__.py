"""What a person sees: tables, progress, magics. The only layer that imports IPython."""
