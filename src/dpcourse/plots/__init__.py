"""The figures of the book, one module per part: they take results and draw them, nothing else.

Chapter 1: the plots of every chapter (each module names its own).
"""
