"""Parts of ``ringreduce.spark`` shared by the estimators (Horovod's ``horovod.spark.common``)."""
