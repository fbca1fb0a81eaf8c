"""The ``gpu-sandbox`` commands, one module each; ``common`` holds what they share.

``gpu_sandbox.cli`` parses the command line and calls the command's function; each module
imports what lies beyond the standard library inside that function, so that the command
line starts with none of it.
"""
