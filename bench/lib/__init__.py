"""Helpers the benchmark scripts share; the scripts sit one level up and run with bench/ on
sys.path, so they import these as `from lib.output import ...`.
"""
