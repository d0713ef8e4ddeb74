"""Rank-side code: runs inside the engines. Imports torch, never a notebook library."""
