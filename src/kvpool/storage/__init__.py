"""kvpool.storage"""
