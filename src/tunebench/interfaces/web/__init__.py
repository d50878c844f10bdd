"""`tunebench serve`: the web app (app.py, on Gradio), the models it offers (models.py) and the A/B vote store (store.py)."""
