"""kvpool.capacity"""
