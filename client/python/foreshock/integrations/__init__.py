"""Callbacks that plug a foreshock Monitor into training frameworks.

    from foreshock.integrations.transformers import ForeshockCallback   # transformers.Trainer
    from foreshock.integrations.lightning import ForeshockCallback      # Lightning Trainer

Importing this package imports neither framework: each module imports its
own framework when it is imported, so `import foreshock` keeps working where
they are not installed.
"""
