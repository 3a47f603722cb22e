"""What the model is shown: the frame (read, select, render), its cap, dates, the rows it
quotes, what a tenant may see, and the plan that keeps it across calls."""
