"""How people reach the jobs: the command line, the Python API, the web app. The top layer."""
