"""kvpool.models"""
