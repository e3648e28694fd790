"""What two or more stages share. Imports no KFP."""
